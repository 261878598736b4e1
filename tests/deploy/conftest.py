"""Fixtures for the deployment tests: the rendered Kubernetes overlays."""

from __future__ import annotations

import pytest
from deploy_tools import K8S, OVERLAYS, kustomize


@pytest.fixture(scope="session", params=OVERLAYS)
def overlay(request) -> dict[tuple[str, str], dict]:
    """One overlay's resources by (kind, name)."""
    return {(r["kind"], r["metadata"]["name"]): r for r in kustomize(K8S / "overlays" / request.param)}
