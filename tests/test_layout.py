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


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    """pipeline's modules -> the pipeline modules they import (a submodule import names the
    submodule, not its package)."""
    modules = {_module_name(p): p for p in (ROOT / "pipeline").rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in modules:
                subs = {f"{node.module}.{a.name}" for a in node.names} & set(modules)
                found |= subs or {node.module}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in modules}
        graph[name] = found - {name}
    return graph


def test_the_import_graph_has_no_cycle():
    graph, state, cycles = _graph(), {}, []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles


def test_the_core_knows_no_wire_and_the_transport_no_protocol():
    graph = _graph()
    wires = {m for m in graph if m.startswith(("pipeline.adapters", "pipeline.adapters.realtime")) or m == "pipeline.adapters.v1.protocol"}
    core = {m for m in graph if m.startswith("pipeline.conversation")}
    assert {(m, w) for m in core for w in graph[m] & wires} == set()
    assert graph["pipeline.connection"] & (wires - {"pipeline.wire"}) == set()


def test_the_conversation_core_and_the_adapters_stay_readable():
    """No module over 300 lines, no class over ~250 (issue 34): the engines are not held to it."""
    big = []
    for path in [*(ROOT / "pipeline" / "conversation").glob("*.py"), *(ROOT / "pipeline" / "adapters").glob("*.py")]:
        text = path.read_text()
        if len(text.splitlines()) > 330:
            big.append((path.name, len(text.splitlines())))
        big += [(f"{path.name}:{n.name}", n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(text))
                if isinstance(n, ast.ClassDef) and n.end_lineno - n.lineno + 1 > 260]
    assert not big
