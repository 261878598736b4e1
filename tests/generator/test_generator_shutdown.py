"""A generator (real vLLM on CPU) told to stop stops cleanly: status 0, no engine death reported,
no shared memory or status folder left behind.

On SIGTERM or SIGINT vLLM's launcher stops the engine, which marks it dead as it goes; that is
not the death `engine_health` reports (an ERROR line, the deaths counter, status 1), which would
page whoever watches for it on every rollout or job end.

vLLM's engine core and worker talk through shared-memory queues (/dev/shm/psm_*) that their
creator unlinks when it is finalized. A forked process (generator_svc.server.engine_start) ends
without finalizers, so what removes them is Python's resource tracker, which the API server
starts before it forks: without it each stop left two in /dev/shm."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import psutil
import pytest

from tests.generator.conftest import Service

pytestmark = pytest.mark.vllm


def test_a_sigterm_stops_the_generator_with_status_0_and_reports_no_engine_death(
    checkpoints, tmp_path
) -> None:
    served = Service(checkpoints["A"], tmp_path / "served.log").wait_ready()
    try:
        served.complete([1, 2, 3], max_tokens=2)  # the engine has served
        segments = _shared_memory_of(served.proc.pid)
        assert segments, "the engine's processes map no shared-memory queue: nothing to check"
        os.kill(served.proc.pid, signal.SIGTERM)  # the main process only, as Kubernetes does
        assert served.proc.wait(120) == 0, served.log_tail()
    finally:
        served.stop()
    log = served.log.read_text(errors="replace")
    assert "a shutdown was asked for" in log, served.log_tail()
    assert "engine died" not in log and "exiting after the engine's death" not in log, served.log_tail()
    assert [path for path in segments if Path(path).exists()] == []
    status = re.search(r"their status in (\S+)", log)
    assert status and not Path(status[1]).exists(), "the workers' status folder is left in /tmp"


def _shared_memory_of(pid: int) -> set[str]:
    """The /dev/shm segments of Python's `SharedMemory` that the generator's processes map."""
    found: set[str] = set()
    for process in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        found |= {m.path for m in process.memory_maps() if m.path.startswith("/dev/shm/psm_")}
    return found
