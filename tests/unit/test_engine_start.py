"""Forked engine processes take the OpenMP binding a spawned one takes from its environment
(generator_svc.server.engine_start); the engines themselves are compared in tests/generator and
tests/e2e."""

from __future__ import annotations

import json
import os

import pytest
import torch

from generator_svc.server.engine_start import bind_like_spawn, omp_binding
from generator_svc.settings import EngineStart, Settings


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, (None, None)),
        ({"OMP_NUM_THREADS": "1", "GOMP_CPU_AFFINITY": "1"}, (1, {1})),
        ({"OMP_NUM_THREADS": "3", "GOMP_CPU_AFFINITY": "0 2 5"}, (3, {0, 2, 5})),
        ({"OMP_NUM_THREADS": "2", "OMP_PLACES": "{4,7}", "OMP_PROC_BIND": "true"}, (2, {4, 7})),
        ({"OMP_NUM_THREADS": "2"}, (2, None)),
        ({"OMP_PLACES": "cores"}, (None, None)),  # a user's own abstract places: not vLLM's binding
    ],
)
def test_reads_both_forms_of_vllms_binding(env: dict[str, str], expected: tuple) -> None:
    assert omp_binding(env) == expected


def test_a_forked_child_is_bound_as_its_environment_says() -> None:
    """The hook in a real forked child: its thread count and cores change, its parent's do not."""
    cores = sorted(os.sched_getaffinity(0))
    want = {"OMP_NUM_THREADS": "1", "GOMP_CPU_AFFINITY": str(cores[-1])}
    parent = (torch.get_num_threads(), sorted(os.sched_getaffinity(0)))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: bind, report, and leave without running pytest's exit handlers
        try:
            os.environ.update(want)
            bind_like_spawn(torch.set_num_threads)
            os.write(write, json.dumps([torch.get_num_threads(), sorted(os.sched_getaffinity(0))]).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child = json.loads(pipe.read())
    os.waitpid(pid, 0)
    assert child == [1, [cores[-1]]]
    assert (torch.get_num_threads(), sorted(os.sched_getaffinity(0))) == parent


def test_settings_take_the_two_ways_and_refuse_others() -> None:
    def settings(**engine_start: str) -> Settings:
        return Settings("", 0, "staged", "0", "", "h", **engine_start)  # type: ignore[arg-type]

    assert settings().engine_start is EngineStart.FORK
    assert settings(engine_start="spawn").engine_start is EngineStart.SPAWN
    with pytest.raises(ValueError, match="engine_start must be one of"):
        settings(engine_start="forkserver")
