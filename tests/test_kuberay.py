"""deploy/kuberay/rayservice.yaml: up to date with serve_config.gpu.yaml, valid against KubeRay's
published RayService CRD (deploy/kuberay/crd/, KubeRay v1.7.0), and consistent with what the app
needs (custom resources, GPUs, grace periods, tokens from Secrets). Nothing here talks to a
cluster: the manifest has not been applied to one."""
from __future__ import annotations

import copy
import functools
import importlib.util
import json
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.serve._private import constants as serve_constants

from deployments import proxy_limits

ROOT = Path(__file__).resolve().parents[1]
KUBERAY = ROOT / "deploy" / "kuberay"
MANIFEST = KUBERAY / "rayservice.yaml"
CRD = KUBERAY / "crd" / "ray.io_rayservices.kuberay-v1.7.0.yaml"


def _render_module():
    spec = importlib.util.spec_from_file_location("kuberay_render", KUBERAY / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _manifest() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def _embedded_config() -> dict:
    return yaml.safe_load(_manifest()["spec"]["serveConfigV2"])


def _pod_templates(manifest: dict) -> dict[str, dict]:
    cluster = manifest["spec"]["rayClusterConfig"]
    pods = {"head": cluster["headGroupSpec"]}
    pods.update({g["groupName"]: g for g in cluster["workerGroupSpecs"]})
    return pods


# --- the CRD's schema, as JSON Schema -------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _crd_version(name: str) -> dict:
    docs = [d for d in yaml.safe_load_all(CRD.read_text()) if d]
    (crd,) = docs
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["names"]["kind"] == "RayService"
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == name]
    assert version["served"], f"{name} is not served by this CRD"
    return {"group": crd["spec"]["group"], "kind": crd["spec"]["names"]["kind"], **version}


def to_json_schema(node, *, close_objects: bool = True):
    """A Kubernetes structural (OpenAPI v3.0) schema as JSON Schema. What needs translating:

    - ``x-kubernetes-*`` keys are dropped (list/map merge semantics, CEL rules: the 3 CEL rules in
      this CRD concern ``managedBy`` and the GCS backend, which the manifest does not set).
      ``x-kubernetes-int-or-string`` already comes with ``anyOf: [integer, string]`` here; where
      it did not, that ``anyOf`` is added.
    - ``nullable: true`` (OpenAPI) becomes ``null`` among the allowed types.
    - Unknown fields: the API server prunes fields its schema does not name, and ``kubectl apply``
      asks it for strict field validation (``fieldValidation=Strict``, kubectl's default), which
      refuses them instead. JSON Schema allows them, so every object that lists ``properties``
      and neither a map schema (``additionalProperties``) nor
      ``x-kubernetes-preserve-unknown-fields`` gets ``additionalProperties: false``. Objects
      with no properties at all (the top-level ``metadata``, which the API server checks as an
      ObjectMeta itself) stay open.
    - ``format: int32/int64`` is checked by :data:`FORMATS`; ``date-time`` appears only in
      ``status``.
    """
    if isinstance(node, list):
        return [to_json_schema(n, close_objects=close_objects) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key == "nullable":
            continue
        if key == "properties":
            out[key] = {name: to_json_schema(s, close_objects=close_objects) for name, s in value.items()}
        elif key in ("items", "additionalProperties", "not", "anyOf", "allOf", "oneOf"):
            out[key] = to_json_schema(value, close_objects=close_objects)
        else:  # type, required, enum, default, format, pattern, minimum, ...: values, not schemas
            out[key] = value
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if (close_objects and out.get("type") == "object" and "properties" in out
            and "additionalProperties" not in out and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


FORMATS = jsonschema.FormatChecker(formats=())


@FORMATS.checks("int32")
def _int32(value) -> bool:
    return not isinstance(value, int) or -2**31 <= value < 2**31


@FORMATS.checks("int64")
def _int64(value) -> bool:
    return not isinstance(value, int) or -2**63 <= value < 2**63


@functools.lru_cache(maxsize=None)
def _validator(close_objects: bool = True) -> jsonschema.protocols.Validator:
    api_version = _manifest()["apiVersion"]
    schema = to_json_schema(_crd_version(api_version.split("/")[1])["schema"]["openAPIV3Schema"],
                            close_objects=close_objects)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema, format_checker=FORMATS)


def _errors(manifest: dict, close_objects: bool = True) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in _validator(close_objects).iter_errors(manifest)]


# --- tests ----------------------------------------------------------------------------------------

def test_rendered_manifest_is_up_to_date():
    """rayservice.yaml is what render.py writes from the template and serve_config.gpu.yaml now."""
    render = _render_module()
    assert MANIFEST.read_text() == render.render(), \
        "deploy/kuberay/rayservice.yaml is stale: run python deploy/kuberay/render.py"
    assert render.main(["--check"]) == 0
    # a changed serve config makes it stale
    changed = (ROOT / "serve_config.gpu.yaml").read_text().replace("max_replicas: 4", "max_replicas: 5")
    assert "max_replicas: 5" in render.render(serve_config=changed) != MANIFEST.read_text()


def test_embedded_serve_config_is_serve_config_gpu():
    embedded = _manifest()["spec"]["serveConfigV2"]
    assert isinstance(embedded, str)  # KubeRay takes the Serve config as one YAML string
    assert embedded == (ROOT / "serve_config.gpu.yaml").read_text()
    assert yaml.safe_load(embedded) == yaml.safe_load((ROOT / "serve_config.gpu.yaml").read_text())


def test_render_refuses_what_it_cannot_embed_verbatim():
    render = _render_module()
    template = (KUBERAY / "rayservice.template.yaml").read_text()
    with pytest.raises(ValueError, match="exactly once"):
        render.render(template.replace(render.PLACEHOLDER, ""), "a: 1\n")
    for bad in ("a: 1", "a: 1\n\n", "a:\n\tb: 1\n", "  a: 1\n"):
        with pytest.raises(ValueError):
            render.render(template, bad)


def test_embedded_serve_config_builds(monkeypatch, tmp_path):
    """The config KubeRay will deploy passes the same checks as serve_config.gpu.yaml itself
    (tests/test_serve_configs.py, pointed at the embedded copy): Serve's schema, every engine,
    session and auth setting built, STT not autoscaled, TTS autoscaling within its slots."""
    from tests import test_serve_configs as checks

    monkeypatch.setenv("GAPLESS_TOKENS", "a-token-for-the-gpu-config")
    (tmp_path / "serve_config.gpu.yaml").write_text(_manifest()["spec"]["serveConfigV2"])
    monkeypatch.setattr(checks, "ROOT", tmp_path)
    checks.test_serve_config_is_valid("serve_config.gpu.yaml")
    checks.test_gpu_config_autoscales_tts_within_its_slots()
    checks.test_served_profiles_are_hands_free("serve_config.gpu.yaml")


def test_manifest_is_valid_against_the_kuberay_crd():
    manifest = _manifest()
    crd = _crd_version("v1")
    assert manifest["apiVersion"] == f"{crd['group']}/{crd['name']}" and manifest["kind"] == crd["kind"]
    assert crd["storage"]  # v1 is the version the API server stores
    assert _errors(manifest) == []


def _set(manifest: dict, path: str, value=None, *, delete: bool = False, rename: str | None = None) -> dict:
    """A copy of manifest with the dotted path set, deleted or its last key renamed."""
    out = copy.deepcopy(manifest)
    *parents, last = path.split(".")
    node = out
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if rename:
        node[rename] = node.pop(last)
    elif delete:
        del node[last]
    else:
        node[last] = value
    return out


WRONG = {
    # a typo'd key under spec: the API server (kubectl's strict field validation) refuses it
    "typo under spec": (dict(path="spec.serveConfigV2", rename="serveConfigv2"), "'serveConfigv2' was unexpected"),
    "typo in a container": (dict(path="spec.rayClusterConfig.workerGroupSpecs.0.template.spec.containers.0.resources",
                                 rename="resource"), "'resource' was unexpected"),
    "rayStartParams value not a string": (dict(path="spec.rayClusterConfig.headGroupSpec.rayStartParams.num-cpus",
                                               value=4), "4 is not of type 'string'"),
    "grace period as a string": (dict(path="spec.rayClusterConfig.headGroupSpec.template.spec."
                                           "terminationGracePeriodSeconds", value="60"), "'60' is not of type 'integer'"),
    "worker group without a name": (dict(path="spec.rayClusterConfig.workerGroupSpecs.0.groupName", delete=True),
                                    "'groupName' is a required property"),
    "unknown auth mode": (dict(path="spec.rayClusterConfig.authOptions.mode", value="tokens"), "'tokens' is not one of"),
    "int32 overflow": (dict(path="spec.rayClusterConfig.workerGroupSpecs.0.maxReplicas", value=2**31),
                       "is not a 'int32'"),
    "serveConfigV2 as a mapping": (dict(path="spec.serveConfigV2", value={"applications": []}), "is not of type 'string'"),
}


@pytest.mark.parametrize("case", list(WRONG))
def test_a_wrong_manifest_is_refused(case):
    """The validation is real: each deliberate mistake is rejected, with the expected reason."""
    change, reason = WRONG[case]
    errors = _errors(_set(_manifest(), **change))
    assert errors and any(reason in e for e in errors), errors


def test_unknown_fields_are_caught_only_by_closing_objects():
    """Why to_json_schema closes objects: the CRD's schema as published, read as JSON Schema,
    lets a typo'd key through (the API server would prune it, or refuse it under kubectl's
    strict field validation)."""
    typo = _set(_manifest(), "spec.serveConfigV2", rename="serveConfigv2")
    assert _errors(typo, close_objects=False) == []
    assert _errors(typo) != []


def _start_param_resources(value: str) -> list[dict]:
    """``rayStartParams.resources`` as read by each of its three readers."""
    # KubeRay (pod.go getResourcesMap): trims quotes and spaces, then parses JSON.
    kuberay = json.loads(value.strip("'\"` "))
    # The shell KubeRay runs `ray start --resources=<value>` in.
    (flag,) = shlex.split(f"--resources={value}")
    shell = json.loads(flag.removeprefix("--resources="))
    # Ray's autoscaler (autoscaling_config._get_custom_resources): drops the outer quotes and backslashes.
    autoscaler = json.loads(value[1:-1].replace("\\", ""))
    return [kuberay, shell, autoscaler]


def test_groups_declare_the_placement_resources():
    """The head and the GPU workers carry docs/scaling.md's custom resources (head_node, model_node),
    every custom resource the Serve config asks for is declared by some group, and only the
    workers have GPUs."""
    manifest = _manifest()
    pods = _pod_templates(manifest)
    declared = {}
    for name, group in pods.items():
        readings = _start_param_resources(group["rayStartParams"]["resources"])
        assert all(r == readings[0] for r in readings), (name, readings)
        declared[name] = readings[0]
    assert declared == {"head": {"head_node": 1}, "gpu": {"model_node": 1}}
    wanted = {r for d in _embedded_config()["applications"][0]["deployments"]
              for r in d.get("ray_actor_options", {}).get("resources", {})}
    assert wanted <= {r for d in declared.values() for r in d}
    (head,) = pods["head"]["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in head["resources"]["limits"]
    (worker,) = pods["gpu"]["template"]["spec"]["containers"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert worker["resources"]["requests"] == worker["resources"]["limits"]


def _cpus(quantity) -> float:
    q = str(quantity)
    return int(q[:-1]) / 1000 if q.endswith("m") else float(q)


def test_replicas_at_their_maximum_fit_the_groups():
    """Every replica the Serve config can ask for (TTS at max_replicas) fits the head and the
    worker group at its maxReplicas, first fit decreasing on (GPU, CPU): the GPU deployments
    can only go to the GPU workers."""
    cluster = _manifest()["spec"]["rayClusterConfig"]
    (head,) = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    nodes = [{"cpu": _cpus(head["resources"]["limits"]["cpu"]), "gpu": 0.0}]
    for group in cluster["workerGroupSpecs"]:
        (c,) = group["template"]["spec"]["containers"]
        nodes += [{"cpu": _cpus(c["resources"]["limits"]["cpu"]),
                   "gpu": float(c["resources"]["limits"].get("nvidia.com/gpu", 0))}
                  for _ in range(group["maxReplicas"])]
    replicas = []
    for d in _embedded_config()["applications"][0]["deployments"]:
        opts = d.get("ray_actor_options", {})
        count = d.get("autoscaling_config", {}).get("max_replicas", d.get("num_replicas", 1))
        replicas += [(d["name"], opts.get("num_gpus", 0), opts.get("num_cpus", 1))] * count
    for name, gpu, cpu in sorted(replicas, key=lambda r: (-r[1], -r[2])):
        node = next((n for n in nodes if n["gpu"] + 1e-9 >= gpu and n["cpu"] + 1e-9 >= cpu), None)
        assert node is not None, f"a {name} replica ({cpu} CPU, {gpu} GPU) fits no node: {nodes}"
        node["gpu"] -= gpu
        node["cpu"] -= cpu


def test_pods_outlast_serves_graceful_shutdown():
    """terminationGracePeriodSeconds exceeds Ray Serve's graceful shutdown of a replica (the
    config's graceful_shutdown_timeout_s, else Serve's default, 20 s, plus its wait loop) and a
    draining proxy's minimum period."""
    deployments = _embedded_config()["applications"][0]["deployments"]
    shutdown = max(d.get("graceful_shutdown_timeout_s", serve_constants.DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S)
                   for d in deployments)
    wait_loop = max(d.get("graceful_shutdown_wait_loop_s", serve_constants.DEFAULT_GRACEFUL_SHUTDOWN_WAIT_LOOP_S)
                    for d in deployments)
    need = max(shutdown + wait_loop, serve_constants.PROXY_MIN_DRAINING_PERIOD_S)
    for name, group in _pod_templates(_manifest()).items():
        assert group["template"]["spec"]["terminationGracePeriodSeconds"] > need, name


def test_tokens_come_from_secrets():
    """The clients' tokens reach every Ray container (the gateway and the app builder may run on
    any node) from a Secret, under the name the config's auth.tokens_env reads; Ray's own token
    is KubeRay's token auth with a named Secret; no token is written in the manifest."""
    manifest = _manifest()
    auth = _embedded_config()["applications"][0]["args"]["auth"]
    assert auth["mode"] == "token" and not auth.get("tokens_file")
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["authOptions"]["mode"] == "token" and cluster["authOptions"]["secretName"]
    images = set()
    for name, group in _pod_templates(manifest).items():
        (container,) = group["template"]["spec"]["containers"]
        images.add(container["image"])
        env = {e["name"]: e for e in container["env"]}
        tokens = env[auth["tokens_env"]]
        assert "value" not in tokens and tokens["valueFrom"]["secretKeyRef"]["name"], name
        assert env[proxy_limits.ENV]["value"] == proxy_limits.CALLBACK, name
        assert not {"RAY_AUTH_TOKEN", "RAY_AUTH_MODE"} & set(env), name  # KubeRay sets them from authOptions
    assert len(images) == 1  # one image for every node: the same code and Ray everywhere
