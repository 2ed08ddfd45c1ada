"""The client examples of docs/clients.md are the files under examples/: each code block that
follows a line ``<!-- example: examples/NAME.py -->`` must be that file's text.

    python scripts/readme_examples.py          # exits 1 naming each block that differs
    python scripts/readme_examples.py --write  # copies the files into docs/clients.md
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = Path("docs") / "clients.md"  # where the examples are shown
BLOCK = re.compile(r"<!-- example: (examples/[\w.]+) -->\n```python\n(.*?)```\n", re.S)


def blocks(readme: str) -> list[tuple[str, str]]:
    """(file, the doc's block of it), in order."""
    return [(m.group(1), m.group(2)) for m in BLOCK.finditer(readme)]


def differing(root: Path = ROOT) -> list[str]:
    return [name for name, text in blocks((root / DOC).read_text()) if (root / name).read_text() != text]


def write(root: Path = ROOT) -> None:
    path = root / DOC
    path.write_text(BLOCK.sub(lambda m: f"<!-- example: {m.group(1)} -->\n```python\n"
                                        f"{(root / m.group(1)).read_text()}```\n", path.read_text()))


if __name__ == "__main__":
    if "--write" in sys.argv:
        write()
    bad = differing()
    if bad:
        sys.exit(f"{DOC} blocks differ from their files: {bad} (python scripts/readme_examples.py --write)")
