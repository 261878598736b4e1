"""Fixtures every end-to-end module shares: the tiny model, one stack of services per module, and
the session's reference engines."""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_harness import References, Stack


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from trainer_svc.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("model"), seed=0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("e2e"))
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def references(tmp_path_factory):
    references = References(tmp_path_factory.mktemp("references"))
    yield references
    references.stop()


@pytest.fixture(autouse=True)
def _stop_trainers(request):
    """After each test, passed or failed, the trainer jobs it started on its module's stack stop."""
    yield
    for name in ("stack", "lab_stack"):
        if name in request.fixturenames:
            value = request.getfixturevalue(name)
            (value[0] if isinstance(value, tuple) else value).stop_trainers()
