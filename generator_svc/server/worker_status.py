"""What each vLLM worker publishes about itself, read by the API server without calling into it.

Every worker writes a small JSON file (`generator_svc.worker_protocol.WorkerStatus`) into a directory
the API server made, every `PUBLISH_INTERVAL_S`, from a thread of its own
(`generator_svc.worker.status_publisher`); this module reads them. The API server's `/healthz`
and `/readyz` read these files and never wait on the engine: a worker that is frozen (SIGSTOP),
dead or wedged stops writing, and a probe still answers at once, with 503 and which worker went quiet.

Readiness also needs the weights: a worker must be registered with syncd (when one is configured)
to know the committed version, and it is behind when syncd has a committed version and the
worker serves another one (after a restart it serves its `--model` checkpoint, which is no trainer
version: `serves` is None), unless it serves an earlier trainer version and a Commit of the
committed version is being applied on it (an ordinary refit in progress).

The files live on the worker's host: this assumes the workers share the API server's host (vLLM's
multiprocessing executor; not multi-node tensor parallelism).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

from generator_svc.worker_protocol import PUBLISH_INTERVAL_S, WorkerInfo, WorkerStatus, status_path

# A worker whose status is older than this is reported not answering: six missed writes, so a busy
# host does not flap the probe, and still well within a liveness probe's period.
QUIET_AFTER_S = 6 * PUBLISH_INTERVAL_S


def read_status(directory: str, member_id: str) -> WorkerStatus | None:
    try:
        raw = json.loads(status_path(directory, member_id).read_text())
    except (OSError, ValueError):
        return None
    return WorkerStatus(**{**raw, "committing": tuple(raw["committing"])})


def quiet_workers(directory: str, workers: Sequence[WorkerInfo], now: float | None = None) -> str:
    """Why some worker is not answering ('' when every one published within QUIET_AFTER_S)."""
    now = time.time() if now is None else now
    problems = []
    for worker in workers:
        status = read_status(directory, worker.member_id)
        if status is None:
            problems.append(f"worker {worker.member_id} (pid {worker.pid}) has published no status")
        elif (age := now - status.written_at) > QUIET_AFTER_S:
            problems.append(
                f"worker {worker.member_id} (pid {worker.pid}) has not answered for "
                f"{age:.1f} s (frozen or dead)"
            )
    return "; ".join(problems)


def behind_workers(directory: str, workers: Sequence[WorkerInfo]) -> str:
    """Why some worker does not serve syncd's committed version ('' when none is behind)."""
    problems = []
    for worker in workers:
        status = read_status(directory, worker.member_id)
        if status is not None and status.unregistered:
            problems.append(
                f"worker {status.member_id} is not registered with syncd yet, so it cannot "
                "know the committed version"
            )
        elif status is not None and status.behind():
            serves = "its start-up checkpoint" if status.serves is None else f"version {status.serves}"
            problems.append(
                f"worker {status.member_id} serves {serves} but syncd committed version "
                f"{status.committed}: waiting for a catch-up refit"
            )
    return "; ".join(problems)
