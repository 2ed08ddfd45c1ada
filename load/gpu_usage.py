"""GPU busy time and memory while a load level runs, sampled from ``nvidia-smi`` (load/cost.py).

``nvidia-smi --query-gpu=utilization.gpu,memory.used -lms PERIOD`` prints, every PERIOD ms, the
share of the last sample period in which a kernel ran on each GPU, and the memory in use. The
mean share times the wall time is the GPU-seconds the level kept a GPU busy (summed over GPUs);
divided by N conversations x the wall time it is GPU-seconds per conversation-second. A coarse
measure (a kernel running is not a GPU full), but the one every GPU exposes; nothing where there
is no nvidia-smi.
"""
from __future__ import annotations

import shutil
import subprocess
import threading

PERIOD_MS = 200
QUERY = ["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used", "--format=csv,noheader,nounits",
         f"-lms={PERIOD_MS}"]


def parse(line: str) -> tuple[int, float, float] | None:
    """(GPU index, busy share 0..1, MiB used) of one nvidia-smi line, None for anything else."""
    parts = [p.strip() for p in line.split(",")]
    try:
        index, util, mem = int(parts[0]), float(parts[1]), float(parts[2])
    except (IndexError, ValueError):
        return None
    return index, util / 100.0, mem


class GPUUsage:
    """Samples nvidia-smi between ``__enter__`` and ``__exit__``; :meth:`summary` then says what it saw."""

    def __init__(self):
        self.samples: list[tuple[int, float, float]] = []
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> "GPUUsage":
        if shutil.which("nvidia-smi"):
            self._proc = subprocess.Popen(QUERY, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            sample = parse(line)
            if sample is not None:
                self.samples.append(sample)

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=10)
            self._reader.join(timeout=10)

    def summary(self, conversations: int) -> dict | None:
        """Per GPU: mean busy share and peak MiB; and GPU-seconds per conversation-second (all GPUs)."""
        if not self.samples:
            return None
        gpus = sorted({i for i, _, _ in self.samples})
        busy = {i: sum(u for j, u, _ in self.samples if j == i) / sum(1 for j, _, _ in self.samples if j == i)
                for i in gpus}
        return {"gpus": len(gpus), "samples": len(self.samples),
                "busy_share": {str(i): round(b, 3) for i, b in busy.items()},
                "memory_used_max_mib": {str(i): max(m for j, _, m in self.samples if j == i) for i in gpus},
                "gpu_s_per_conversation_s": round(sum(busy.values()) / conversations, 4)}
