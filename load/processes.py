"""CPU time of the app's own processes on this machine, by role, read with psutil.

Ray names its worker processes after what they run (``ray::ServeReplica:gapless:Gateway``,
``ray::ProxyActor``, ...), so a load tool on the same machine can say how much CPU the gateway or
the HTTP proxy spent while it talked to them. :func:`session_roles` goes further and gives every
process of the app's Ray session a role: the replicas and Serve's actors by their titles, the
``raylet`` and ``gcs_server`` by their executables, and everything else of the session (the
``serve run`` driver, the dashboard and its heads, the log monitor, the autoscaler monitor, the
dashboard and runtime-env agents, idle workers) as ``other_ray``. A child process of a replica
(a compile worker, say) counts as its replica.
"""
from __future__ import annotations

import os
import re
from typing import NamedTuple

import psutil

ROLES = {"gateway": "ServeReplica:gapless:Gateway", "proxy": "ProxyActor", "stt": "ServeReplica:gapless:STT",
         "llm": "ServeReplica:gapless:LLM", "tts": "ServeReplica:gapless:TTS",
         "tickets": "ServeReplica:gapless:TicketLedger", "controller": "ServeController"}
EXECUTABLES = {"raylet": "raylet", "gcs_server": "gcs"}
# every role of a session, in the order a report lists them
SESSION_ROLES = ("gateway", "stt", "llm", "tts", "tickets", "proxy", "controller", "raylet", "gcs", "other_ray")
_SESSION_DIR = re.compile(r"/(session_[0-9][\w-]*)")


class ProcInfo(NamedTuple):
    pid: int
    ppid: int
    name: str
    cmdline: tuple[str, ...]


def role_of(name: str, cmdline: tuple[str, ...] | list[str]) -> str | None:
    """The role a process has by its own title (``ray::<actor>``) or executable, None if neither says."""
    title = cmdline[0] if cmdline else ""
    for role, marker in ROLES.items():
        if marker in title or marker in name:
            return role
    exe = os.path.basename(title)
    for executable, role in EXECUTABLES.items():
        if name == executable or exe == executable:
            return role
    return None


def session_roles(table: list[ProcInfo]) -> dict[int, str]:
    """pid -> role for every process of the Ray session that runs the app's gateway.

    The session is the raylet above the gateway replica, everything whose command line names that
    raylet's session directory (gcs_server, the dashboard, the monitors), the raylet's parent when it
    is a ``serve``/``ray`` command (``serve run``'s driver), and all their descendants. Another Ray
    session on the same machine is left out. Empty if no gateway runs here."""
    by_pid = {p.pid: p for p in table}
    own = {p.pid: role_of(p.name, p.cmdline) for p in table}
    gateway = next((pid for pid, role in own.items() if role == "gateway"), None)
    if gateway is None:
        return {}
    raylet = _ancestor(by_pid, gateway, lambda pid: own[pid] == "raylet")
    if raylet is None:  # not under a raylet (should not happen): its classified processes are all we know
        return {pid: role for pid, role in own.items() if role}
    seeds = {raylet}
    found = _SESSION_DIR.search(" ".join(by_pid[raylet].cmdline))
    if found:
        seeds |= {p.pid for p in table if found.group(1) in " ".join(p.cmdline)}
    parent = by_pid.get(by_pid[raylet].ppid)
    if parent is not None and any(os.path.basename(part) in ("serve", "ray") for part in parent.cmdline[:2]):
        seeds.add(parent.pid)
    children: dict[int, list[int]] = {}
    for p in table:
        children.setdefault(p.ppid, []).append(p.pid)
    members, todo = set(), list(seeds)
    while todo:
        pid = todo.pop()
        if pid not in members:
            members.add(pid)
            todo.extend(children.get(pid, ()))
    roles = {}
    for pid in members:
        # a process with no title of its own is its nearest titled ancestor's (a replica's child
        # is the replica's), unless that is the raylet, the GCS or nothing: then it is other Ray
        owner = _ancestor(by_pid, pid, lambda a: a in members and own[a] is not None)
        role = own[owner] if owner is not None else None
        roles[pid] = role if role in ROLES or pid == owner else "other_ray"
    return roles


def _ancestor(by_pid: dict[int, ProcInfo], pid: int, test) -> int | None:
    """``pid`` or its nearest ancestor that passes ``test``."""
    seen = set()
    while pid in by_pid and pid not in seen:
        if test(pid):
            return pid
        seen.add(pid)
        pid = by_pid[pid].ppid
    return None


def process_table() -> list[ProcInfo]:
    table = []
    for proc in psutil.process_iter(["pid", "ppid", "name", "cmdline"]):
        info = proc.info
        table.append(ProcInfo(info["pid"], info["ppid"] or 0, info["name"] or "", tuple(info["cmdline"] or ())))
    return table


def session_processes() -> dict[str, list[psutil.Process]]:
    """role -> the running processes of the app's Ray session (every role of SESSION_ROLES present)."""
    found: dict[str, list[psutil.Process]] = {role: [] for role in SESSION_ROLES}
    for pid, role in session_roles(process_table()).items():
        try:
            found[role].append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return found


def processes(role: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        if role_of(proc.info["name"] or "", proc.info["cmdline"] or ()) == role:
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


class CPUSample(NamedTuple):
    role: str
    cpu_s: float  # user + system seconds since the process started
    started: float  # psutil create_time: tells a reused pid from the process it had before


def session_cpu() -> dict[int, CPUSample]:
    """pid -> role and CPU seconds so far, for every process of the app's Ray session."""
    samples = {}
    for role, procs in session_processes().items():
        for proc in procs:
            try:
                t = proc.cpu_times()
                samples[proc.pid] = CPUSample(role, t.user + t.system, proc.create_time())
            except psutil.NoSuchProcess:
                pass
    return samples
