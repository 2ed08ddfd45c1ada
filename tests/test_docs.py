"""The docs name what exists. In README.md, docs/*.md and deploy/kuberay/README.md, a name in
backticks that is:

- a file or folder of this repository (a span ending in a file extension, or whose first part is one
  of the repository's top-level folders) exists: from the repository's root, from the doc's own
  folder, or, a bare file name, somewhere in the tree;
- a module or attribute of the project (``pipeline.*``, ``load.*``, ``deployments.*``, and every
  ``python -m X`` of the docs' commands) imports and resolves;
- a setting (``session.X``, ``stt.X``, ``tts.X``, ``llm.X``, ``auth.X``, ``phone.X``; a carrier's
  ``phone.twilio.X``, ``phone.telnyx.X``) is a field of that config;
  ``session.X`` may also be a key of the Realtime session object or a session event (``ready``,
  ``update``, ``updated``, ``created``).

- a settings table's default (a row "| `name` | 300 | ..." of docs/protocol.md or docs/llm.md) is
  the config class's default: numbers that docs and code both state have one source, the code.

The exceptions, each with its reason, are below. Anything under ``out/`` is what a command writes
when it runs, so it is not checked."""
from __future__ import annotations

import dataclasses
import importlib
import re
import subprocess
from pathlib import Path

import pytest

from pipeline.door.auth import AuthConfig
from pipeline.llm.config import LLMConfig
from pipeline.adapters.phone.config import CarrierAccount, PhoneConfig
from pipeline.adapters.realtime.session_object import SESSION_KEYS
from pipeline.session_config import LIMIT_NAMES, SETTING_NAMES, ReplicaLimits, SessionConfig
from pipeline.stt.config import STTConfig
from pipeline.tts.config import TTSConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "kuberay" / "README.md"]
EXTENSIONS = ("py", "sh", "yaml", "yml", "md", "json", "png", "wav", "txt", "toml", "html", "js", "tsv")
# Files named in the docs that are not this repository's, or exist only once a command has run.
NOT_OURS = {
    "cache_aware_rnnt.yaml": "NeMo's own pipeline config (docs/stt.md compares against it)",
    "summary.json": "written by the GPU scripts into their output folder",
    "tables.md": "written by load/gpu_serve.sh into its output folder",
    "facts.tsv": "written by load/gpu_serve.sh into its output folder",
    "modules/streaming.py": "moshi's (the style model named in the docs)",
    "/tmp/ray/prom_metrics_service_discovery.json": "written by Ray's head node while it runs (docs/scaling.md)",
    "dist.umd/msgpack.min.js": "the file of the @msgpack/msgpack npm package that web/vendor/ holds",
}
SESSION_EVENTS = {"ready", "update", "updated", "created"}
SETTINGS = {"session": SessionConfig, "stt": STTConfig, "tts": TTSConfig, "llm": LLMConfig, "auth": AuthConfig,
            "phone": PhoneConfig, "carrier": CarrierAccount}


def _spans(doc: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    return re.findall(r"`([^`\n]+)`", text)


def _commands(doc: Path) -> list[str]:
    return re.findall(r"python -m ([\w.]+)", doc.read_text())


def _tracked() -> list[str]:
    return subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()


TOP = {p.split("/")[0] for p in _tracked() if "/" in p}


def _is_path(span: str) -> bool:
    if not re.fullmatch(r"[\w./-]+", span) or span.startswith("out/"):
        return False
    return span.rsplit(".", 1)[-1] in EXTENSIONS or span.split("/")[0] in TOP and "/" in span


def _exists(span: str, doc: Path, names: set[str]) -> bool:
    span = span.rstrip("/")
    return (ROOT / span).exists() or (doc.parent / span).exists() or ("/" not in span and span in names)


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_named_files_exist(doc):
    names = {Path(p).name for p in _tracked()}
    missing = sorted({s for s in _spans(doc) if _is_path(s) and s not in NOT_OURS and not _exists(s, doc, names)})
    assert not missing, f"{doc.name} names files that do not exist: {missing}"


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for part in parts[i:]:
                obj = getattr(obj, part)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_named_modules_and_commands_resolve(doc):
    dotted = {s for s in _spans(doc) if re.fullmatch(r"(pipeline|load|deployments)(\.\w+)+", s)}
    dotted |= {c for c in _commands(doc) if c.split(".")[0] in ("pipeline", "load", "deployments")}
    unresolved = sorted(d for d in dotted if not _resolves(d))
    assert not unresolved, f"{doc.name} names modules or attributes that do not exist: {unresolved}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_named_settings_exist(doc):
    fields = {k: {f.name for f in dataclasses.fields(c)} for k, c in SETTINGS.items()}
    fields["session"] = SETTING_NAMES | LIMIT_NAMES  # the yaml's session: holds both
    unknown = []
    for span in _spans(doc):
        span = re.sub(r"^phone\.(twilio|telnyx)\.", "carrier.", span)
        m = re.fullmatch(r"(session|stt|tts|llm|auth|phone|carrier)\.(\w+)(?:[:=].*)?", span)
        if not m or m.group(2) in ("py", "md"):
            continue
        kind, name = m.groups()
        if name in fields[kind] or kind == "session" and (name in SESSION_KEYS or name in SESSION_EVENTS):
            continue
        unknown.append(span)
    assert not unknown, f"{doc.name} names settings that do not exist: {sorted(set(unknown))}"


def test_the_check_catches_a_missing_name(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("See `pipeline/nothing_here.py`, `load.no_such_tool` and `session.no_such_setting`.")
    assert _is_path("pipeline/nothing_here.py") and not _exists("pipeline/nothing_here.py", doc, set())
    assert not _resolves("load.no_such_tool") and _resolves("load.gaps.SPOKEN")
    assert "no_such_setting" not in {f.name for f in dataclasses.fields(SessionConfig)}


# Numbers that docs and code both state have one source, the code: a settings table's defaults
# (a row "| `name` | default | ..." in these docs) must be the config class's defaults. Other docs
# say a setting's default by pointing at these tables, not by stating it again.
DEFAULT_TABLES = {"protocol.md": (SessionConfig, ReplicaLimits), "llm.md": (LLMConfig,)}  # doc -> its configs


def _default_rows(text: str) -> list[tuple[str, str]]:
    """(setting, stated default) of each table row whose first cell names settings in backticks
    and whose second cell starts with numbers: several settings and values split on commas."""
    rows = []
    for names, value in re.findall(r"^\| ((?:`\w+`(?:, )?)+) \| ([-\d.]+(?:, [-\d.]+)*)\b", text, flags=re.M):
        names, values = re.findall(r"`(\w+)`", names), value.split(", ")
        if len(names) == len(values):
            rows += list(zip(names, values))
    return rows


@pytest.mark.parametrize("doc", sorted(DEFAULT_TABLES))
def test_a_settings_tables_defaults_are_the_codes(doc):
    sources = [config() for config in DEFAULT_TABLES[doc]]
    rows = _default_rows((ROOT / "docs" / doc).read_text())
    assert len(rows) >= 8, rows
    wrong = {}
    for name, stated in rows:
        source = next((s for s in sources if hasattr(s, name)), None)
        if source is not None and float(getattr(source, name)) != float(stated):
            wrong[name] = (stated, getattr(source, name))
    assert not wrong, f"docs/{doc} states defaults the code does not have (stated, code): {wrong}"


def test_the_defaults_check_catches_a_changed_number():
    text = "| `idle_timeout_s` | 301 | no frame |\n| `temperature`, `top_k` | 0.7, 50 | all |\n"
    assert _default_rows(text) == [("idle_timeout_s", "301"), ("temperature", "0.7"), ("top_k", "50")]
    assert float(SessionConfig().idle_timeout_s) != 301.0
