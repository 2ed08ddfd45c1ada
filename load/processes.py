"""CPU time of the app's own processes on this machine, by role, read with psutil.

Ray names its worker processes after what they run (``ray::ServeReplica:gapless:Gateway``,
``ray::ProxyActor``, ...), so a load tool on the same machine can say how much CPU the gateway or
the HTTP proxy spent while it talked to them.
"""
from __future__ import annotations

import psutil

ROLES = {"gateway": "ServeReplica:gapless:Gateway", "proxy": "ProxyActor", "stt": "ServeReplica:gapless:STT",
         "llm": "ServeReplica:gapless:LLM", "tts": "ServeReplica:gapless:TTS"}


def processes(role: str) -> list[psutil.Process]:
    marker = ROLES[role]
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(marker in part for part in proc.info["cmdline"] or ()):
            found.append(proc)
    return found


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


class ProcessCPU:
    """CPU seconds each role's processes spent since this was made."""

    def __init__(self, roles: tuple[str, ...] = ("gateway", "proxy")):
        self.procs = {role: processes(role) for role in roles}
        missing = [role for role, procs in self.procs.items() if not procs]
        if missing:
            raise RuntimeError(f"no running process for {missing} on this machine (is the app up here?)")
        self.start = {role: cpu_seconds(procs) for role, procs in self.procs.items()}

    def spent(self) -> dict[str, float]:
        return {role: cpu_seconds(procs) - self.start[role] for role, procs in self.procs.items()}
