"""What crosses the boundary between the API-server process and vLLM's worker processes.

The API server (`generator_svc.server`, or `generator_svc.attach` for an engine a user built) and the
workers (`generator_svc.worker`) never import each other; they share these types instead.

- `WorkerStatus`: what each worker publishes about itself into a status file (JSON, `status_path`),
  which the API server's probes read without calling into the worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from syncd.weight_version import WeightVersion

# How often each worker rewrites its status file; the API server's probes count missed writes.
PUBLISH_INTERVAL_S = 0.5


@dataclass(frozen=True)
class WorkerStatus:
    member_id: str
    pid: int
    unregistered: bool  # syncd is configured but this worker has no session with it (yet)
    serves: WeightVersion | None  # the trainer version it serves; None: none (its start-up checkpoint)
    committed: WeightVersion | None  # syncd's committed version as it last heard it; None: none or no syncd
    committing: tuple[WeightVersion, ...]  # versions whose Commit this worker is applying
    written_at: float  # time.time() of the write

    def behind(self) -> bool:
        if self.committed is None or self.serves == self.committed:
            return False
        # A Commit of the committed version being applied on a worker that serves an earlier
        # trainer version is a refit in progress, not a worker left behind. A worker on its
        # start-up checkpoint stays behind until the install has landed.
        return self.serves is None or self.committed not in self.committing


def status_path(directory: str, member_id: str) -> Path:
    """Where the worker `member_id` publishes its `WorkerStatus`, in the API server's `directory`."""
    return Path(directory) / f"{member_id}.json"
