"""The subset of kustomize that deploy/k8s uses, so the tests render overlays without a kustomize
binary: `resources` (files and directories), `patches` (strategic-merge patch files) and `images`.

Strategic merge follows Kubernetes' rules for the fields used here: maps merge recursively, a
`null` deletes a key, lists of containers/volumes/env/volumeMounts/ports merge by their key and
every other list is replaced. A kustomization using anything else is refused, so an overlay
cannot silently rely on a feature this renderer ignores.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = ("cpu-demo", "gpu")

SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "patches", "images"}
# List fields that merge element-wise, and the key naming an element (Kubernetes' patchMergeKey).
MERGE_KEYS = {
    "containers": "name", "initContainers": "name", "volumes": "name", "env": "name",
    "volumeMounts": "mountPath", "ports": "containerPort",
}

Resource = dict[str, Any]


def load_all(path: Path) -> list[Resource]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def render(directory: Path) -> list[Resource]:
    """The resources `kustomize build directory` would print, in order."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - SUPPORTED_KEYS
    if unknown:
        raise ValueError(f"{directory}/kustomization.yaml uses {sorted(unknown)}; "
                         f"the test renderer supports {sorted(SUPPORTED_KEYS)}")
    resources: list[Resource] = []
    for entry in kustomization.get("resources", []):
        target = (directory / entry).resolve()
        resources += render(target) if target.is_dir() else load_all(target)
    for patch_entry in kustomization.get("patches", []):
        if set(patch_entry) != {"path"}:
            raise ValueError(f"{directory}: only `patches: [{{path: ...}}]` is supported, got {patch_entry}")
        for patch in load_all(directory / patch_entry["path"]):
            resources = [_apply(r, patch) for r in resources]
            if not any(_same(r, patch) for r in resources):
                raise ValueError(f"{directory}/{patch_entry['path']}: no resource "
                                 f"{patch['kind']}/{patch['metadata']['name']} to patch")
    for image in kustomization.get("images", []):
        for r in resources:
            for c in _containers(r):
                if c["image"].split(":")[0] == image["name"]:
                    c["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    return resources


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value, key)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list) and field in MERGE_KEYS:
        key = MERGE_KEYS[field]
        out = [copy.deepcopy(item) for item in base]
        for item in patch:
            match = next((i for i, old in enumerate(out) if old.get(key) == item.get(key)), None)
            if match is None:
                out.append(copy.deepcopy(item))
            else:
                out[match] = strategic_merge(out[match], item)
        return out
    return copy.deepcopy(patch)


def _same(resource: Resource, patch: Resource) -> bool:
    return (resource["kind"], resource["metadata"]["name"]) == (patch["kind"], patch["metadata"]["name"])


def _apply(resource: Resource, patch: Resource) -> Resource:
    return strategic_merge(resource, patch) if _same(resource, patch) else resource


def _containers(resource: Resource) -> list[dict]:
    spec = resource.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("containers", []) + spec.get("initContainers", [])
