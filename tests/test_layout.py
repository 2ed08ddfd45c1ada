"""The house's rules, read from the code (docs/conversation.md, "The house"):

- nothing in pipeline/ imports Ray, and the engine contract (pipeline/engines.py) imports no model
  package;
- no import runs back up: the rooms of the house (each child of pipeline/, and deployments/ and
  load/) import each other without a circle, and no module imports itself round a circle;
- pipeline/ keeps at most 15 modules at its top: the rest is in folders by concern;
- no class is over 300 lines in pipeline/ or deployments/, the conversation core's and the
  adapters' over 250;
- an adapter talks to the core through ``do`` and its events: no ``core.X.Y`` in pipeline/adapters/,
  and the core knows no wire.

Each rule can fail: ``test_the_rules_catch_what_they_forbid`` feeds each one an example."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ("pipeline", "deployments", "load")
MAX_TOP_MODULES = 15
MAX_CLASS_LINES = 300
MAX_CORE_CLASS_LINES = 250  # the conversation core's classes and the adapters'
CHAIN = re.compile(r"\b_?core\.[A-Za-z_]\w*\.[A-Za-z_]\w*")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for tree in TREES for p in (ROOT / tree).rglob("*.py")}


def _graph() -> dict[str, set[str]]:
    """The house's modules -> the house's modules they import, at any depth of the code (a
    submodule import names the submodule, not its package)."""
    modules = _modules()
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


def _room(module: str) -> str:
    """pipeline.conversation.ears.vad -> pipeline.conversation; deployments.app -> deployments."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "pipeline" and len(parts) > 1 else parts[0]


def _rooms(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {}
    for module, imported in graph.items():
        rooms.setdefault(_room(module), set()).update(_room(m) for m in imported)
    return {room: imported - {room} for room, imported in rooms.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state, cycles = {}, []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def _label(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def _big_classes(paths, limit: int) -> list[tuple[str, int]]:
    return [(f"{_label(p)}:{n.name}", n.end_lineno - n.lineno + 1) for p in paths
            for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ClassDef)
            and n.end_lineno - n.lineno + 1 > limit]


def _chains(paths) -> list[str]:
    return [f"{_label(p)}:{i}: {m.group(0)}" for p in paths
            for i, line in enumerate(p.read_text().splitlines(), 1)
            for m in CHAIN.finditer(line.split("#", 1)[0])]


def test_the_engine_contract_imports_no_model_package():
    upward = {m for m in _imports(ROOT / "pipeline" / "engines.py")
              if m.startswith(("pipeline.stt", "pipeline.tts", "pipeline.llm"))}
    assert not upward


def test_pipeline_is_free_of_ray():
    users = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "pipeline").rglob("*.py")
                   if any(m == "ray" or m.startswith("ray.") for m in _imports(p)))
    assert not users


def test_no_module_imports_itself_round_a_circle():
    assert not _cycles(_graph())


def test_no_import_runs_back_up_between_the_rooms():
    rooms = _rooms(_graph())
    assert {"pipeline.conversation", "pipeline.adapters", "deployments", "load"} <= set(rooms)
    assert not _cycles(rooms)


def test_pipeline_keeps_at_most_15_modules_at_its_top():
    top = sorted(p.name for p in (ROOT / "pipeline").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_TOP_MODULES, top


def test_no_class_is_over_300_lines_and_the_cores_and_adapters_over_250():
    assert not _big_classes([p for tree in ("pipeline", "deployments") for p in (ROOT / tree).rglob("*.py")],
                            MAX_CLASS_LINES)
    core = [*(ROOT / "pipeline" / "conversation").glob("*.py"), *(ROOT / "pipeline" / "adapters").rglob("*.py"),
            ROOT / "pipeline" / "wire.py"]
    assert not _big_classes(core, MAX_CORE_CLASS_LINES)


def test_adapters_talk_to_the_core_through_do_and_its_events():
    assert not _chains(list((ROOT / "pipeline" / "adapters").rglob("*.py")))


def test_the_core_knows_no_wire_and_the_transport_no_protocol():
    graph = _graph()
    wires = {m for m in graph if m.startswith("pipeline.adapters")}
    core = {m for m in graph if m.startswith("pipeline.conversation")}
    assert {(m, w) for m in core for w in graph[m] & wires} == set()
    assert graph["pipeline.connection"] & wires == set()
    assert graph["pipeline.wire"] & wires == set()


def test_the_rules_catch_what_they_forbid(tmp_path):
    """Each rule, fed an example of what it forbids, reports it."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles(_rooms({"pipeline.x.m": {"pipeline.y.n"}, "pipeline.y.n": {"pipeline.x.k"}, "pipeline.x.k": set()}))
    assert not _cycles(_rooms({"pipeline.x.m": {"pipeline.x.k"}, "pipeline.x.k": {"pipeline.y"}, "pipeline.y": set()}))
    big = tmp_path / "big.py"
    big.write_text("class Big:\n" + "    x = 1\n" * 300)
    assert _big_classes([big], MAX_CLASS_LINES) == [("big.py:Big", 301)]
    adapter = tmp_path / "adapter.py"
    adapter.write_text("x = self.core.history.items  # a chain\ny = self.core.do(c)\n# self.core.a.b in a comment\n")
    assert _chains([adapter]) == ["adapter.py:1: core.history.items"]
