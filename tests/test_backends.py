"""Both implementations of the session's Backends protocol (in-process services, Ray deployment
handles) declare it and keep exactly its methods and signatures; pipeline/ never imports Ray."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from deployments.backends import RayBackends
from pipeline.services import LocalBackends
from pipeline.engines import Backends

ROOT = Path(__file__).resolve().parents[1]
IMPLEMENTATIONS = [LocalBackends, RayBackends]


def _methods(cls) -> dict:
    """The public instance methods ``cls`` itself defines (classmethods such as build() are not part
    of the protocol)."""
    return {name: fn for name, fn in vars(cls).items() if not name.startswith("_") and inspect.isfunction(fn)}


def test_the_protocol_has_the_session_calls():
    assert set(_methods(Backends)) == {"stt_open", "stt_push", "stt_finish", "stt_peek", "stt_close",
                                       "llm_stream", "tts_stream", "tts_encode", "tts_open", "tts_feed",
                                       "tts_close"}


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_implementation_declares_the_protocol(cls):
    assert Backends in cls.__mro__, f"{cls.__name__} must subclass pipeline.engines.Backends"
    assert not cls.__abstractmethods__, f"{cls.__name__} leaves {sorted(cls.__abstractmethods__)} unimplemented"


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_implementation_matches_the_protocol(cls):
    protocol, own = _methods(Backends), _methods(cls)
    assert set(own) == set(protocol), (f"{cls.__name__}: missing {sorted(set(protocol) - set(own))}, "
                                       f"not in the protocol {sorted(set(own) - set(protocol))}")
    for name, spec in protocol.items():
        impl = own[name]
        # Annotations evaluated (the modules use postponed annotations; RayBackends' methods are
        # wrapped by _engine_call, whose functools.wraps leads signature() to the method itself).
        want, got = inspect.signature(spec, eval_str=True), inspect.signature(impl, eval_str=True)
        assert got == want, f"{cls.__name__}.{name}{got} differs from Backends.{name}{want}"
        assert inspect.iscoroutinefunction(impl) == inspect.iscoroutinefunction(spec), (
            f"{cls.__name__}.{name}: async def in one, a plain def returning an iterator in the other")


def test_pipeline_never_imports_ray():
    """Everything under pipeline/ runs without Ray (tests, tools); only deployments/ may import it."""
    offenders = []
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] == "ray"]
    assert offenders == []
