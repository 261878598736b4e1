"""How vLLM on CPU starts the engine's processes: by fork (our default) or by spawn (vLLM's).

vLLM's CPU platform forces spawn: the engine core and every worker are fresh interpreters that
import vLLM and torch again, 15-20 s of CPU each on a small machine, while the API server that
starts them has both imported already. A forked process starts in well under a second.

Spawn matters to one thing vLLM does: it binds a worker's OpenMP threads through the environment
it starts the worker in (`OMP_NUM_THREADS`, and `GOMP_CPU_AFFINITY` or `OMP_PLACES`, set around
the worker's start). OpenMP reads those once, when it starts, so a forked worker, whose OpenMP started in its
parent, would ignore them: it computed with every core's threads, so its outputs differed from a
spawned worker's (by up to 4e-3 in logprobs) and each request cost it twice the CPU. So
`start_engines_by_fork` also applies that binding in every forked child: the thread count, and the
cores as the process's affinity (which the threads OpenMP starts later inherit). A forked worker
then computes exactly what a spawned one computes: the tests compare generators started this way
bit for bit against engines vLLM starts itself (`tests/generator`, `tests/e2e`).

The shared memory vLLM's processes talk through is unlinked, as under spawn, by Python's resource
tracker, started in the API server before the forks (`tests/generator/test_generator_shutdown.py`).

Forked engines also spin less. vLLM's processes pass messages through shared memory, and a reader
spins (yielding its core) for a second after each message before it sleeps on a socket: on a GPU
machine that spin is on a spare core; on CPU it is on a core the engines compute on. On a 2-core
VM a tiny engine's worker used 1.1 s of CPU per request when requests came 3 s apart, nearly all
of it that spin. A forked engine's readers spin for `READER_SPIN_S`, longer than the gap between
a step's output and the next step's input, so decoding still never sleeps between steps.

Fork copies the API server as it is when the engine starts: vLLM imported, no engine or syncd
connection yet (generator_svc starts the engine first). That is how vLLM starts its engines on
GPUs. The API server's listening socket is open by then, and a forked child closes its copy: one
that kept it would keep the port bound after the API server ended, and it made vLLM's shutdown
fail when it looked for the port's holder and found a worker that had just exited.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
from collections.abc import Mapping
from multiprocessing import resource_tracker
from typing import Any

from generator_svc.settings import EngineStart

log = logging.getLogger("generator_svc.engine_start")

_MARK = "_generator_svc_fork_start"
READER_SPIN_S = 0.02  # vLLM's `SpinCondition.busy_loop_s` in forked engines (vLLM's default: 1 s)


def omp_binding(env: Mapping[str, str]) -> tuple[int | None, set[int] | None]:
    """The OpenMP thread count and cores vLLM put in a worker's environment, as (threads, cores);
    None where it set nothing. Cores come from `GOMP_CPU_AFFINITY` ("0 1 2", with libgomp
    preloaded) or `OMP_PLACES` ("{0,1,2}", otherwise): vLLM's two forms (`OMPProcessManager`)."""
    threads = int(env["OMP_NUM_THREADS"]) if env.get("OMP_NUM_THREADS") else None
    if env.get("GOMP_CPU_AFFINITY"):
        cores: set[int] | None = {int(c) for c in env["GOMP_CPU_AFFINITY"].split()}
    elif env.get("OMP_PLACES", "").startswith("{"):
        cores = {int(c) for c in env["OMP_PLACES"].strip("{}").split(",")}
    else:
        cores = None
    return threads, cores


def bind_like_spawn(set_num_threads: Any) -> None:
    """In a forked child: the binding a spawned process would have taken from its environment."""
    threads, cores = omp_binding(os.environ)
    if cores:
        os.sched_setaffinity(0, cores)
    if threads:
        set_num_threads(threads)


def start_engines_by_fork(listening: socket.socket | None = None) -> bool:
    """Make vLLM fork the engine core and its workers on CPU (see the module's docstring), closing
    `listening` (the API server's socket) in each. Call before the engine is built; idempotent.
    Returns whether engines will fork: False off CPU, where vLLM picks its own way (it forks unless
    CUDA is already initialized)."""
    import torch

    from generator_svc.vllm_adapter import CpuPlatform, current_platform

    if not current_platform.is_cpu():
        return False
    if listening is not None:
        os.register_at_fork(after_in_child=listening.close)
    original = CpuPlatform.check_and_update_config.__func__
    if getattr(original, _MARK, False):
        return True

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        original(cls, vllm_config)  # sets spawn, with the rest of its CPU environment
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = EngineStart.FORK.value

    # vLLM's engine core and worker talk through shared memory (/dev/shm/psm_*) that the creator
    # unlinks when finalized, and a forked process ends without finalizers (os._exit). Python's
    # resource tracker unlinks what is left once every process holding it has ended; started here,
    # before the forks, the API server and every child share it, as spawned children share their
    # parent's. Without it each stop left two segments behind.
    resource_tracker.ensure_running()
    setattr(check_and_update_config, _MARK, True)
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    readers_spin_for(READER_SPIN_S)
    # vLLM's worker replaces torch.set_num_threads with a no-op once bound; keep the real one.
    os.register_at_fork(after_in_child=functools.partial(bind_like_spawn, torch.set_num_threads))
    log.info(
        "vLLM's engine processes start by fork, bound to their cores as spawned ones are; their "
        "message readers spin %.0f ms before they sleep",
        READER_SPIN_S * 1000,
    )
    return True


def readers_spin_for(seconds: float) -> None:
    """Readers of vLLM's shared-memory queues created from now on spin `seconds` (see above)."""
    from generator_svc.vllm_adapter import SpinCondition

    original = SpinCondition.__init__

    def spinning_less(
        self: Any, is_reader: bool, context: Any, notify_address: str, busy_loop_s: float = seconds
    ) -> None:
        original(self, is_reader, context, notify_address, busy_loop_s)

    SpinCondition.__init__ = spinning_less
