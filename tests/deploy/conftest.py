"""Fixtures for the deployment tests: the rendered Kubernetes overlays."""

from __future__ import annotations

import pytest

from deploy_kustomize import K8S, OVERLAYS, render


@pytest.fixture(scope="session", params=OVERLAYS)
def overlay(request) -> dict[tuple[str, str], dict]:
    """One overlay's resources by (kind, name)."""
    return {(r["kind"], r["metadata"]["name"]): r for r in render(K8S / "overlays" / request.param)}
