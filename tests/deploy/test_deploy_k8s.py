"""deploy/k8s: every manifest is valid Kubernetes, the overlays render, and what the manifests say
about ports, flags, env vars and probe paths is what the services actually accept."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from deploy_tools import K8S, OVERLAYS, kustomizations, kustomize

K8S_VERSION = "1.33.0"  # the Kubernetes release whose OpenAPI schemas the manifests must satisfy
CRD_KINDS = {"ServiceMonitor"}
# kubernetes-validate ships only core schemas. The ServiceMonitor is checked against the fields we
# use from monitoring.coreos.com/v1 (the prometheus-operator CRD), which is what a typo would break.
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "properties": {"matchLabels": {"type": "object"}},
                    "additionalProperties": False,
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["port"],
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                        },
                    },
                },
            },
        },
    },
}


def _kustomizations() -> dict[Path, dict]:
    return {d: yaml.safe_load((d / "kustomization.yaml").read_text()) for d in kustomizations()}


@pytest.mark.parametrize("directory", kustomizations(), ids=lambda d: str(d.relative_to(K8S)))
def test_every_rendered_manifest_matches_the_kubernetes_schema(directory):
    """Every kustomization's output as kubectl renders it: the base and monitoring resources, and
    each overlay's result."""
    resources = kustomize(directory)
    assert resources, f"kubectl kustomize {directory} rendered nothing"
    for resource in resources:
        if resource["kind"] in CRD_KINDS:
            jsonschema.validate(resource, SERVICE_MONITOR_SCHEMA)
        else:
            _validate_strict(resource)


def test_every_yaml_file_is_a_resource_or_a_patch_of_some_kustomization():
    used = set()
    for directory, k in _kustomizations().items():
        used |= {(directory / r).resolve() for r in k.get("resources", [])}
        used |= {(directory / p["path"]).resolve() for p in k.get("patches", [])}
    orphans = [p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml" and p.resolve() not in used]
    assert not orphans, f"not referenced by any kustomization.yaml (so never validated): {orphans}"


def _validate_strict(resource: dict) -> None:
    # strict: unknown fields are errors (a misspelt `livenessProbe` would otherwise pass).
    try:
        kubernetes_validate.validate(resource, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        pytest.fail(f"{resource['kind']}/{resource['metadata']['name']}: {e.message} at {list(e.path)}")


@pytest.mark.parametrize("name", OVERLAYS)
def test_rendered_overlays_are_complete(name):
    kinds = {(r["kind"], r["metadata"]["name"]) for r in kustomize(K8S / "overlays" / name)}
    assert {
        ("Deployment", "syncd"),
        ("Service", "syncd"),
        ("Secret", "syncd-auth"),
        ("PersistentVolumeClaim", "syncd-data"),
        ("Deployment", "generator"),
        ("StatefulSet", "trainer"),
        ("Service", "trainer"),
    } <= kinds


def test_overlays_pick_their_image_variant(overlay):
    images = {c["image"] for r in overlay.values() for c in _containers(r, init=True)}
    assert len(images) == 1 and images.pop().split(":")[1] in ("cpu", "gpu")


def test_a_patch_of_a_missing_resource_fails_the_render(tmp_path):
    """kubectl's errors reach the tests: an overlay patching something the base lacks is an error,
    not a silently unpatched manifest."""
    shutil.copytree(K8S / "base", tmp_path / "base")
    (tmp_path / "kustomization.yaml").write_text("resources: [base]\npatches: [{path: typo.yaml}]\n")
    (tmp_path / "typo.yaml").write_text("apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: syncdd}\n")
    with pytest.raises(RuntimeError, match="syncdd"):
        kustomize(tmp_path)


# -- agreement with the services' settings ---------------------------------------------------------


def _containers(resource: dict, init: bool = False) -> list[dict]:
    spec = resource.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("containers", []) + (spec.get("initContainers", []) if init else [])


def _container(overlay, kind: str, name: str) -> dict:
    (container,) = _containers(overlay[(kind, name)])
    return container


def _literal_env(container: dict) -> dict[str, str]:
    """The container's environment as the process sees it; downward-API and secret values get
    placeholders of the right shape."""
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "secretKeyRef" in var["valueFrom"]:
            env[var["name"]] = "token-from-secret"
        else:
            env[var["name"]] = "10.0.0.7"  # status.podIP
    return env


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of command and args; an undefined $(VAR) would stay literal."""

    def one(arg: str) -> str:
        out = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg)
        assert "$(" not in out, f"{arg!r} names a variable the container does not define"
        return out

    return [one(a) for a in args]


def _port(container: dict, name_or_number) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name_or_number]
    return port


def _syncd_settings(overlay):
    from syncd.daemon.settings import Settings

    container = _container(overlay, "Deployment", "syncd")
    env = _literal_env(container)
    known = set(Settings.env_vars().values())
    assert set(env) <= known, f"syncd does not read {sorted(set(env) - known)}; it reads {sorted(known)}"
    assert container["command"] == ["python", "-m", "syncd"]
    return Settings.load(container.get("args", []), environ=env), container


def _service_port(overlay, service: str, name: str) -> int:
    (port,) = [p["port"] for p in overlay[("Service", service)]["spec"]["ports"] if p["name"] == name]
    return port


def test_syncd_ports_probes_and_service_agree_with_its_settings(overlay):
    from syncd.daemon.http_app import build_app

    settings, container = _syncd_settings(overlay)
    assert _port(container, "http") == settings.http_port
    assert _port(container, "grpc") == settings.grpc_port
    for p in overlay[("Service", "syncd")]["spec"]["ports"]:
        expected = {"http": settings.http_port, "grpc": settings.grpc_port}[p["name"]]
        assert _port(container, p["targetPort"]) == expected
    routes = {r.path for r in build_app(None, None, None, None).routes}
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = container[probe]["httpGet"]
        assert get["path"] == path and get["path"] in routes
        assert _port(container, get["port"]) == settings.http_port
    annotations = overlay[("Deployment", "syncd")]["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == settings.http_port and "/metrics" in routes
    assert settings.auth_token == "token-from-secret"
    assert settings.db.startswith(container["volumeMounts"][0]["mountPath"] + "/")


def _generator(overlay, monkeypatch):
    from generator_svc import settings as gen_settings

    container = _container(overlay, "Deployment", "generator")
    assert container["command"] == ["python", "-m", "generator_svc"]
    env = _literal_env(container)
    for name, value in env.items():
        monkeypatch.setenv(name, value)  # add_arguments reads GENERATOR_* as defaults
    settings, args = gen_settings.parse(_expand(container["args"], env))
    return settings, args, container


def test_generator_flags_env_and_probes_agree_with_generator_svc(overlay, monkeypatch):
    from generator_svc.server.routes import router

    settings, args, container = _generator(overlay, monkeypatch)
    assert _port(container, "http") == args.port
    assert _port(container, overlay[("Service", "generator")]["spec"]["ports"][0]["targetPort"]) == args.port
    host, port = settings.syncd.split(":")
    assert host == "syncd" and int(port) == _service_port(overlay, "syncd", "grpc")
    assert settings.auth_token == "token-from-secret" and settings.data_host == "10.0.0.7"
    routes = {r.path for r in router.routes}
    # Readiness is /readyz: it also waits for syncd's committed version, which liveness must not.
    probes = (("startupProbe", "/healthz"), ("livenessProbe", "/healthz"), ("readinessProbe", "/readyz"))
    for probe, path in probes:
        get = container[probe]["httpGet"]
        assert get["path"] == path and path in routes and _port(container, get["port"]) == args.port
    annotations = overlay[("Deployment", "generator")]["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == args.port
    assert args.model.startswith(container["volumeMounts"][0]["mountPath"] + "/")


def _trainer(overlay):
    from torch.distributed.run import get_args_parser

    from trainer_svc.settings import TrainSettings

    sts = overlay[("StatefulSet", "trainer")]
    container = _container(overlay, "StatefulSet", "trainer")
    assert container["command"] == ["python", "-m", "torch.distributed.run"]
    argv = _expand(container["args"], _literal_env(container))
    torchrun = get_args_parser().parse_args(argv)
    assert torchrun.module and torchrun.training_script == "trainer_svc"
    return sts, torchrun, TrainSettings.from_argv(torchrun.training_script_args)


def test_trainer_args_parse_and_the_mesh_fills_the_statefulset(overlay):
    sts, torchrun, settings = _trainer(overlay)
    replicas = sts["spec"]["replicas"]
    assert torchrun.nnodes == str(replicas), "TRAINER_NNODES must equal the StatefulSet's replicas"
    world = replicas * int(torchrun.nproc_per_node)
    assert settings.dims.world_size == world, (
        f"pp x dp x ep x tp = {settings.dims.world_size} but the StatefulSet runs {world} ranks"
    )
    host, port = settings.syncd.split(":")
    assert host == "syncd" and int(port) == _service_port(overlay, "syncd", "grpc")
    assert settings.sync_refit and settings.data_host == "10.0.0.7"
    # c10d rendezvous on pod 0 through the headless Service, on a port that Service exposes.
    rdzv_host, rdzv_port = torchrun.rdzv_endpoint.split(":")
    service = overlay[("Service", "trainer")]
    assert service["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == service["metadata"]["name"]
    assert rdzv_host == f"{sts['metadata']['name']}-0.{service['metadata']['name']}"
    assert int(rdzv_port) in {p["port"] for p in service["spec"]["ports"]}
    affinity = sts["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    (term,) = affinity["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"


def test_syncd_expects_exactly_the_members_the_overlay_runs(overlay, monkeypatch):
    syncd, _ = _syncd_settings(overlay)
    sts, torchrun, _ = _trainer(overlay)
    assert syncd.expected_trainers == sts["spec"]["replicas"] * int(torchrun.nproc_per_node)
    _, args, _ = _generator(overlay, monkeypatch)
    replicas = overlay[("Deployment", "generator")]["spec"]["replicas"]
    assert syncd.expected_generators == replicas * args.tensor_parallel_size


def test_gpu_overlay_requests_one_gpu_per_rank():
    resources = {(r["kind"], r["metadata"]["name"]): r for r in kustomize(K8S / "overlays" / "gpu")}
    trainer = _container(resources, "StatefulSet", "trainer")
    env = _literal_env(trainer)
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == env["TRAINER_NPROC_PER_NODE"]
    generator = _container(resources, "Deployment", "generator")
    tp = next(a.split("=")[1] for a in generator["args"] if a.startswith("--tensor-parallel-size="))
    assert generator["resources"]["limits"]["nvidia.com/gpu"] == tp
