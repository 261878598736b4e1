"""Each worker's status file: what it serves, rewritten every `PUBLISH_INTERVAL_S` from a thread of
its own, so the API server's probes (`generator_svc.server.worker_status`) read it without calling
into the worker, and a frozen or dead worker shows as one that stopped writing.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import asdict

from generator_svc.worker_protocol import PUBLISH_INTERVAL_S, WorkerStatus, status_path

log = logging.getLogger("generator_svc.worker.status_publisher")


class StatusPublisher:
    """Writes `current()` to this worker's status file every PUBLISH_INTERVAL_S until `stop`."""

    def __init__(self, directory: str, member_id: str, current: Callable[[], WorkerStatus]) -> None:
        self.path = status_path(directory, member_id)
        self._current = current
        self._stopped = threading.Event()
        self.publish()  # the file exists before ws_setup returns
        self._thread = threading.Thread(target=self._loop, name=f"{member_id}-status", daemon=True)
        self._thread.start()

    def publish(self) -> None:
        scratch = self.path.with_suffix(".tmp")
        scratch.write_text(json.dumps(asdict(self._current())))
        os.replace(scratch, self.path)  # readers never see half a file

    def _loop(self) -> None:
        while not self._stopped.wait(PUBLISH_INTERVAL_S):
            try:
                self.publish()
            except Exception:  # keep publishing: a missing status reads as a dead worker
                log.exception("could not write %s", self.path)

    def stop(self) -> None:
        self._stopped.set()
