"""Fixtures every end-to-end module shares: the tiny model, and one stack of services per module."""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_harness import Stack


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from trainer_svc.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("model"), seed=0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("e2e"))
    yield stack
    stack.stop()
