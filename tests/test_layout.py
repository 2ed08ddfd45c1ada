"""The layout's import rules: the engine contract (pipeline/engines.py) stands below the model
packages, so it imports none of them (the TTS's prompt reads the contract's Segment, not the other
way round), and nothing in pipeline/ imports Ray."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_engine_contract_imports_no_model_package():
    upward = {m for m in _imports(ROOT / "pipeline" / "engines.py")
              if m.startswith(("pipeline.stt", "pipeline.tts", "pipeline.llm"))}
    assert not upward


def test_pipeline_is_free_of_ray():
    users = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "pipeline").rglob("*.py")
                   if any(m == "ray" or m.startswith("ray.") for m in _imports(p)))
    assert not users
