"""The summary of a GPU check script's steps (load/gpu_check.sh, load/gpu_device.sh):

    python -m load.step_summary OUT_DIR STEPS_TSV LABEL

STEPS_TSV has a line per step (name, exit status, seconds); each step's log is OUT_DIR/NAME.log.
Writes OUT_DIR/summary.json (each step's status, seconds and last JSON line), prints one JSON line
{LABEL: {step: {rc, seconds}}}, and exits 1 if any step failed.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def last_json(log: Path) -> dict | None:
    last = None
    for text in log.read_text(errors="replace").splitlines():
        text = text.strip()
        if text.startswith("{"):
            try:
                last = json.loads(text)
            except ValueError:
                pass
    return last


def main(argv: list[str]) -> int:
    out, steps, label = Path(argv[0]), Path(argv[1]), argv[2]
    summary = {}
    for line in steps.read_text().splitlines():
        name, rc, seconds = line.split("\t")
        summary[name] = {"rc": int(rc), "seconds": int(seconds), "result": last_json(out / f"{name}.log")}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({label: {k: {"rc": v["rc"], "seconds": v["seconds"]} for k, v in summary.items()}}))
    return 0 if all(v["rc"] == 0 for v in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
