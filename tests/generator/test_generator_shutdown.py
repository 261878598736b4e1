"""A generator (real vLLM on CPU) told to stop stops cleanly: status 0, and no engine death reported.

On SIGTERM or SIGINT vLLM's launcher stops the engine, which marks it dead as it goes; that is
not the death `engine_health` reports (an ERROR line, the deaths counter, status 1), which would
page whoever watches for it on every rollout or job end."""

from __future__ import annotations

import os
import signal

import pytest

from tests.generator.conftest import Service

pytestmark = pytest.mark.vllm


def test_a_sigterm_stops_the_generator_with_status_0_and_reports_no_engine_death(
    checkpoints, tmp_path
) -> None:
    served = Service(checkpoints["A"], tmp_path / "served.log").wait_ready()
    try:
        served.complete([1, 2, 3], max_tokens=2)  # the engine has served
        os.kill(served.proc.pid, signal.SIGTERM)  # the main process only, as Kubernetes does
        assert served.proc.wait(120) == 0, served.log_tail()
    finally:
        served.stop()
    log = served.log.read_text(errors="replace")
    assert "a shutdown was asked for" in log, served.log_tail()
    assert "engine died" not in log and "exiting after the engine's death" not in log, served.log_tail()
