"""Fixtures for the control-plane tests (helpers live in syncd_harness.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from syncd_harness import Cluster, base_settings

from syncd.daemon.service import Daemon


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    clusters: list[Cluster] = []

    def make(**overrides: object) -> Cluster:
        daemon = Daemon(base_settings(tmp_path, **overrides))
        daemon.start()
        cluster = Cluster(
            daemon, httpx.Client(base_url=f"http://127.0.0.1:{daemon.settings.http_port}", timeout=30)
        )
        clusters.append(cluster)
        return cluster

    yield make
    for c in clusters:
        c.close()
        c.daemon.stop()


@pytest.fixture
def cluster(make_cluster: Callable[..., Cluster]) -> Cluster:
    return make_cluster()
