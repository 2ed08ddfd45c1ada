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
  the config class's default, and names a setting some config has: numbers that docs and code both
  state have one source, the code. So is a default stated in prose ("`name` ... 30 s by default")
  and a value a shipped config is said to have ("`name` ... `serve_config.yaml` ships 10");
- an environment variable (an upper-case name in backticks that is no constant of the code) is
  read by the code, the scripts or the configs;
- a route (``/v1/...``, ``/healthz``, ``/metrics``, with or without its method) is served by the
  gateway;

and every metric the dashboards and alert rules under grafana/ query is defined in
pipeline/metrics.py. Each check is fed an example of what it forbids (the ``catches`` tests).

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


def _missing_files(doc: Path) -> list[str]:
    names = {Path(p).name for p in _tracked()}
    return sorted({s for s in _spans(doc) if _is_path(s) and s not in NOT_OURS and not _exists(s, doc, names)})


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_named_files_exist(doc):
    missing = _missing_files(doc)
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


def _unresolved(doc: Path) -> list[str]:
    dotted = {s for s in _spans(doc) if re.fullmatch(r"(pipeline|load|deployments)(\.\w+)+", s)}
    dotted |= {c for c in _commands(doc) if c.split(".")[0] in ("pipeline", "load", "deployments")}
    return sorted(d for d in dotted if not _resolves(d))


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_named_modules_and_commands_resolve(doc):
    unresolved = _unresolved(doc)
    assert not unresolved, f"{doc.name} names modules or attributes that do not exist: {unresolved}"


def _unknown_settings(doc: Path) -> list[str]:
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
    return sorted(set(unknown))


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_named_settings_exist(doc):
    unknown = _unknown_settings(doc)
    assert not unknown, f"{doc.name} names settings that do not exist: {unknown}"


def test_the_checks_catch_a_missing_name(tmp_path):
    """A doc that names a file, a module and a setting that do not exist, beside ones that do:
    each check reports the missing one, and only it."""
    doc = tmp_path / "x.md"
    doc.write_text("See `pipeline/nothing_here.py` and `pipeline/engines.py`, `load.no_such_tool` and "
                   "`load.gaps.SPOKEN`, `session.no_such_setting` and `session.idle_timeout_s`.")
    assert _missing_files(doc) == ["pipeline/nothing_here.py"]
    assert _unresolved(doc) == ["load.no_such_tool"]
    assert _unknown_settings(doc) == ["session.no_such_setting"]


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
    wrong = _wrong_defaults(rows, sources)
    assert not wrong, f"docs/{doc} states defaults the code does not have (stated, code): {wrong}"


def _wrong_defaults(rows: list[tuple[str, str]], sources: list) -> dict:
    """{setting: (stated, the code's)} for each row whose default is not the code's, or whose
    setting no config has (the code's: None)."""
    wrong = {}
    for name, stated in rows:
        source = next((s for s in sources if hasattr(s, name)), None)
        if source is None or getattr(source, name) is None or float(getattr(source, name)) != float(stated):
            wrong[name] = (stated, None if source is None else getattr(source, name))
    return wrong


def test_the_defaults_check_catches_a_changed_number_and_a_setting_no_config_has():
    text = ("| `idle_timeout_s` | 301 | no frame |\n| `temperature`, `top_k` | 0.7, 50 | all |\n"
            "| `no_such_limit` | 5 | nothing |\n")
    rows = _default_rows(text)
    assert rows == [("idle_timeout_s", "301"), ("temperature", "0.7"), ("top_k", "50"), ("no_such_limit", "5")]
    assert _wrong_defaults(rows, [SessionConfig(), LLMConfig()]) == {"idle_timeout_s": ("301", 300.0),
                                                                     "no_such_limit": ("5", None)}


# ----------------------------------------------------------------------------- defaults and shipped values in prose
def _configs() -> list:
    return [SessionConfig(), ReplicaLimits(), STTConfig(), TTSConfig(), LLMConfig(), AuthConfig(), PhoneConfig()]


def _yaml_settings(path: Path) -> dict[str, object]:
    """A serve config's settings, by name (every section of the app's args, flattened)."""
    import yaml

    args = yaml.safe_load(path.read_text())["applications"][0]["args"]
    return {k: v for section in args.values() if isinstance(section, dict) for k, v in section.items()}


PROSE_DEFAULT = re.compile(r"`(\w+)`[^`\n|]{0,40}?\(?([-\d.]+) ?(?:s|ms|KiB|bytes)? by default")
PROSE_SHIPPED = re.compile(r"`(\w+)`[^`\n|]{0,80}?`(serve_config(?:\.gpu)?\.yaml)` ships ([-\d.]+)")


def _prose_drift(text: str) -> dict:
    """{(setting, where): (stated, actual)} for each default or shipped value stated in prose that
    is not the code's (or the config's)."""
    drift = {}
    for name, stated in PROSE_DEFAULT.findall(text):
        source = next((c for c in _configs() if hasattr(c, name)), None)
        if source is None:
            continue  # not a setting of ours (a page's option, a tool's flag)
        actual = getattr(source, name)
        if not isinstance(actual, (int, float)) or float(actual) != float(stated):
            drift[(name, "default")] = (stated, actual)
    for name, config, stated in PROSE_SHIPPED.findall(text):
        actual = _yaml_settings(ROOT / config).get(name)
        if not isinstance(actual, (int, float)) or float(actual) != float(stated):
            drift[(name, config)] = (stated, actual)
    return drift


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_defaults_and_shipped_values_stated_in_prose_are_the_codes_and_the_configs(doc):
    drift = _prose_drift(doc.read_text())
    assert not drift, f"{doc.name} states values the code or the configs do not have (stated, actual): {drift}"


def test_the_prose_check_catches_a_changed_default_and_a_changed_shipped_value():
    good = "`tool_timeout_s` passed (30 s by default; `serve_config.yaml` ships 10)"
    assert _prose_drift(good) == {}
    assert _prose_drift(good.replace("30 s", "20 s").replace("ships 10", "ships 12")) == {
        ("tool_timeout_s", "default"): ("20", 30.0), ("tool_timeout_s", "serve_config.yaml"): ("12", 10)}


# ----------------------------------------------------------------------------- metrics the dashboards query
def _defined_metrics() -> set[str]:
    text = (ROOT / "pipeline" / "metrics.py").read_text()
    return set(re.findall(r"(?:Counter|Gauge|Histogram)\(\s*\"(voice_\w+)\"", text))


def _queried(text: str) -> set[str]:
    """The voice_ metrics an expression queries, by the name they are defined with."""
    return {re.sub(r"_(bucket|sum|count|total|created)$", "", name) for name in re.findall(r"\bvoice_\w+", text)}


def test_every_metric_the_dashboards_and_alerts_query_is_defined():
    used = set()
    for path in [*(ROOT / "grafana").rglob("*.json"), *(ROOT / "grafana").rglob("*.yml")]:
        used |= _queried(path.read_text())
    assert used and not used - _defined_metrics(), sorted(used - _defined_metrics())


def test_the_metrics_check_catches_an_undefined_metric():
    queried = _queried('sum(rate(voice_audio_chunk_gap_seconds_bucket[5m])) / voice_no_such_thing_total')
    assert queried - _defined_metrics() == {"voice_no_such_thing"}


# ----------------------------------------------------------------------------- environment variables
# Variables the docs name that others read (their own documentation says what they do).
NOT_READ_BY_US = {
    "SSL_CERT_FILE": "Python's ssl, httpx and websockets read it (the tests' clients trust a test certificate)",
    "OMP_NUM_THREADS": "OpenMP's (torch's threads)",
    "CUDA_VISIBLE_DEVICES": "CUDA's",
    "HF_HOME": "Hugging Face's cache",
    "HF_HUB_OFFLINE": "Hugging Face's",
    "RAY_ADDRESS": "Ray's: the cluster a command talks to",
    "RAY_AUTH_MODE": "Ray's CLI",
    "PYTHONPATH": "Python's",
    "TORCH_LOGS": "torch's logging (docs/stall.md: what recompiled, and why)",
}


def _constants() -> set[str]:
    found = set()
    for tree in ("pipeline", "deployments", "load", "scripts", "tests"):
        for path in (ROOT / tree).rglob("*.py"):
            found |= set(re.findall(r"^\s*([A-Z][A-Z0-9_]+)\s*[:=]", path.read_text(), flags=re.M))
    return found


def _read_somewhere(name: str) -> bool:
    """Whether the code, the scripts, the configs, CI or a test (one that reads a switch of its
    own) names ``name``: any tracked source but this file and the docs."""
    for path in _tracked():
        if path.endswith((".py", ".sh", ".yaml", ".yml", ".toml", "run", ".js")) \
                and not path.startswith("docs/") and path != "tests/test_docs.py":
            full = ROOT / path
            if full.is_file() and name in full.read_text(errors="ignore"):
                return True
    return False


def _unread_variables(doc_text: str, constants: set[str]) -> list[str]:
    text = re.sub(r"```.*?```", "", doc_text, flags=re.S)
    names = {m.lstrip("$") for m in re.findall(r"`(\$?[A-Z][A-Z0-9]*_[A-Z0-9_]+)(?:=[^`]*)?`", text)}
    return sorted(n for n in names if n not in constants and n not in NOT_READ_BY_US and not _read_somewhere(n))


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_environment_variable_the_docs_name_is_read(doc):
    unread = _unread_variables(doc.read_text(), _constants())
    assert not unread, f"{doc.name} names environment variables nothing reads: {unread}"


def test_the_variables_check_catches_one_nothing_reads():
    assert _unread_variables("set `GAPLESS_TOKENS` and `$GAPLESS_NO_SUCH_VAR`", set()) == ["GAPLESS_NO_SUCH_VAR"]


# ----------------------------------------------------------------------------- routes
def _paths(router) -> list[str]:
    """Every route's path under a FastAPI router, included routers walked (Serve's ingress moves
    the gateway's routes into one)."""
    out = []
    for route in router.routes:
        if hasattr(route, "original_router"):
            out += [route.include_context.prefix + p for p in _paths(route.original_router)]
        elif getattr(route, "path", None):
            out.append(route.path)
    return out


def _served() -> list[re.Pattern]:
    import deployments.gateway  # noqa: F401 - its modules register the routes
    from deployments.ingress import api

    return [re.compile(re.sub(r"\{\w+\}", "[^/]+", path) + "/?") for path in _paths(api)]


def _unserved(doc_text: str, served: list[re.Pattern]) -> list[str]:
    text = re.sub(r"```.*?```", "", doc_text, flags=re.S)
    paths = {m for m in re.findall(r"`(?:(?:GET|POST|PUT|DELETE) )?(/v1/[\w/{}.-]*|/healthz|/metrics)(?:\?[^`]*)?`", text)}
    return sorted(p for p in paths if not any(pattern.fullmatch(p) for pattern in served))


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_route_the_docs_name_is_served(doc):
    unserved = _unserved(doc.read_text(), _served())
    assert not unserved, f"{doc.name} names routes the gateway does not serve: {unserved}"


def test_the_routes_check_catches_a_route_not_served():
    served = _served()
    assert _unserved("`POST /v1/realtime/calls`, `/v1/realtime/calls/{call_id}/hangup`, `GET /v1/nothing`", served) \
        == ["/v1/nothing"]


# ----------------------------------------------------------------------------- guides and measurements apart
# docs/*.md are guides: how a thing works, how to use it, how to measure it. What was measured, on
# which day and with which command, is in docs/measurements/<area>.md, newest first, and the guide
# cites that file: a number stated in two places comes from one.
MEASUREMENTS = ROOT / "docs" / "measurements"
GUIDES = sorted((ROOT / "docs").glob("*.md"))
# Guides that still hold their measurements, each with its reason.
NOT_YET_SPLIT: dict[str, str] = {}
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
COMMAND = re.compile(r"python -m |bash |pytest")


def _dated(text: str) -> list[str]:
    """The lines of a guide that date something: every date but a setting's change ("it was 150
    before 2026-12-04", "until", "since") and a measurements file's section named in quotes
    (docs/measurements/x.md, "2026-12-03")."""
    lines = []
    for line in text.splitlines():
        for m in DATE.finditer(line):
            before = line[:m.start()]
            if not (before.endswith('"') or re.search(r"\b(before|until|since) $", before)):
                lines.append(line.strip())
                break
    return lines


@pytest.mark.parametrize("doc", [g for g in GUIDES if g.name not in NOT_YET_SPLIT], ids=lambda d: d.name)
def test_a_guide_holds_no_dated_measurement(doc):
    dated = _dated(doc.read_text())
    assert not dated, f"docs/{doc.name} dates a measurement: move it to docs/measurements/ and cite it: {dated}"


def _sections(text: str) -> list[tuple[str, str]]:
    """(heading, heading and body) of each ``## `` section."""
    parts = re.split(r"^(?=## )", text, flags=re.M)
    return [(p.splitlines()[0], p) for p in parts if p.startswith("## ")]


def _undated_or_unordered(text: str) -> list[str]:
    """What is wrong with a measurements file: a section whose heading has no date (an undated
    result says the day it was committed: "Undated (committed 2026-12-01, 2819e05)"), sections not
    newest first, no section at all, or no command (in backticks or a code block) that made them."""
    sections = _sections(text)
    problems = [f"undated: {h}" for h, _ in sections if not DATE.search(h)]
    dates = [DATE.search(h).group() for h, _ in sections if DATE.search(h)]
    if dates != sorted(dates, reverse=True):
        problems.append(f"not newest first: {dates}")
    if not sections:
        problems.append("no dated section")
    spans = re.findall(r"```.*?```|`[^`\n]+`", text, flags=re.S)
    if not any(COMMAND.search(s) for s in spans):
        problems.append("no command")
    return problems


@pytest.mark.parametrize("path", sorted(MEASUREMENTS.glob("*.md")), ids=lambda p: p.name)
def test_a_measurements_file_is_dated_newest_first_with_its_commands(path):
    problems = _undated_or_unordered(path.read_text())
    assert not problems, f"docs/measurements/{path.name}: {problems}"


def _citations() -> str:
    return "\n".join(p.read_text() for p in [ROOT / "README.md", *GUIDES])


def test_every_measurements_file_is_cited_by_a_guide_and_every_one_cited_exists():
    cited = set(re.findall(r"docs/measurements/([\w-]+\.md)", _citations()))
    files = {p.name for p in MEASUREMENTS.glob("*.md")}
    assert files, "docs/measurements/ holds no file"
    assert not files - cited, f"no guide (nor README.md) cites docs/measurements/{sorted(files - cited)}"
    missing = cited - files - set(NOT_YET_SPLIT)
    assert not missing, f"the docs cite measurements files that do not exist: {sorted(missing)}"


def test_the_measurements_checks_catch_a_dated_guide_and_an_undated_file():
    guide = ('## Measured 2026-12-03: barge-in\nSix runs on 2026-12-02.\n- **At the first chunk** (2026-12-03).\n'
             'It was 150 before 2026-12-04 (docs/measurements/turn-taking.md, "2026-12-04 (afternoon)").\n')
    assert _dated(guide) == ["## Measured 2026-12-03: barge-in", "Six runs on 2026-12-02.",
                             "- **At the first chunk** (2026-12-03)."]
    good = "# M\n## 2026-12-04: `python -m load.gaps`\nx\n## Undated (committed 2026-12-01, abc1234): y\n"
    assert _undated_or_unordered(good) == []
    assert _undated_or_unordered(good.replace("2026-12-04", "a day")) == ["undated: ## a day: `python -m load.gaps`"]
    assert _undated_or_unordered(good.replace("`python -m load.gaps`", "load.gaps")) == ["no command"]
    assert _undated_or_unordered(good.replace("2026-12-01", "2026-12-05")) == [
        "not newest first: ['2026-12-04', '2026-12-05']"]
