"""What tests that run in a lab of hosts (`deploy.lab`) share: skip with the reason where this
machine cannot run one (not root, no `ip`/`tc`/`nsenter`), except that CI's
WEIGHTSYNC_REQUIRE_TOOLS=1 turns the skip into a failure, so CI cannot pass by skipping."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from deploy.lab import Lab, missing_requirements


def require_lab() -> None:
    """Skip the calling test when no lab can run here (fail under WEIGHTSYNC_REQUIRE_TOOLS=1)."""
    problems = missing_requirements()
    if problems:
        reason = "no lab on this machine: " + "; ".join(problems)
        if os.environ.get("WEIGHTSYNC_REQUIRE_TOOLS") == "1":
            pytest.fail(f"WEIGHTSYNC_REQUIRE_TOOLS=1 but {reason}")
        pytest.skip(reason)


def lab_name(tag: str) -> str:
    """A lab name unique to this test process (labs of parallel runs must not collide)."""
    return f"{tag}{os.getpid() % 100000}"[:11]


@contextmanager
def running_lab(hosts: Sequence[str], tag: str, logs: Path, **kwargs) -> Iterator[Lab]:
    """A lab for one test or module; removed when the test ends, failed or not."""
    require_lab()
    with Lab(hosts, name=lab_name(tag), logs=logs, **kwargs) as lab:
        yield lab
