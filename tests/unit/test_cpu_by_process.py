"""`python -m tests.cpu_by_process -- CMD`: the command's status, and its CPU by kind of process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.cpu_by_process import kind_of

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "command, kind",
    [
        ("VLLM::Worker_TP1 python -B -c from multiprocessing.spawn import spawn_main", "vLLM worker"),
        (
            "python python -B -c from multiprocessing.spawn import spawn_main",
            "vLLM process (spawned)",
        ),
        ("python python -m generator_svc --model m --port 1", "generator_svc API server"),
        ("python python -m torch.distributed.run --standalone -m trainer_svc", "torchrun agent"),
        ("python python -u -m trainer_svc --pp 1", "trainer rank"),
        ("python python -m syncd --host 127.0.0.1", "syncd"),
        ("bash bash -c true", "other"),
    ],
)
def test_each_process_of_the_suite_has_its_kind(command, kind):
    assert kind_of(command) == kind


def test_it_runs_the_command_keeps_its_status_and_counts_its_children():
    child = "import time; time.sleep(1.5)"  # longer than a sample, so it is seen
    command = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}]); sys.exit(3)"
    run = subprocess.run(
        [sys.executable, "-m", "tests.cpu_by_process", "--", sys.executable, "-c", command],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 3, run.stderr
    header, *rows = run.stderr.strip().splitlines()
    assert "kind" in header and rows, run.stderr
    assert sum(int(row.split()[2]) for row in rows) == 2, run.stderr  # the command and its child
