"""Progress reports while a member transfers: the receive loops count each bucket that arrived
(`ArrivedBytes`, through `LoopOptions.on_received`), and a reporter thread of its own sends the
running totals per link to syncd a few times a second at most (`reporting`).

Off the data path by construction: a loop only adds a bucket's size to a counter; the reporter
reads the counters and talks to syncd on its own thread, skips a report when nothing changed, and
never raises into the transfer (a report syncd does not take only leaves the progress older).
A member whose client cannot report progress (a test's reporter) or whose interval is 0 reports
none; its TRANSFERRED report still completes its links in syncd's view.

What counts as arrived: on CPU, a bucket whose receive completed. On GPUs the host only enqueues
(`syncd.member.dataplane.executor`), so a bucket counts once its receive is ordered on the stream,
at most a few buckets ahead of the wire (the loop's throttle). Links over CUDA IPC are not
counted: they complete with TRANSFERRED, in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping

import grpc

from syncd.plan.types import Bucket

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_ENV = "WEIGHTSYNC_PROGRESS_INTERVAL_S"
DEFAULT_PROGRESS_INTERVAL_S = 0.25

ProgressSender = Callable[[str, Mapping[tuple[int, str], int]], None]


def interval_from_env() -> float:
    """Seconds between a member's progress reports: `WEIGHTSYNC_PROGRESS_INTERVAL_S`, 0 for none
    (benchmarks compare), else 0.25."""
    value = os.environ.get(PROGRESS_INTERVAL_ENV, "")
    if not value:
        return DEFAULT_PROGRESS_INTERVAL_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise ValueError(
            f"{PROGRESS_INTERVAL_ENV} must be seconds >= 0 (0: no progress reports), not {value!r}"
        )
    return seconds


class ArrivedBytes:
    """Bytes of each link into this member, (stage, src) -> bytes, that arrived in one transfer.
    The stage loops add from their threads; the reporter reads a copy."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._links: dict[tuple[int, str], int] = {}

    def add(self, bucket: Bucket) -> None:
        key = (bucket.stage, bucket.src)
        with self._lock:
            self._links[key] = self._links.get(key, 0) + bucket.nbytes

    def snapshot(self) -> dict[tuple[int, str], int]:
        with self._lock:
            return dict(self._links)


class _Reporter:
    """Sends `arrived`'s totals every `interval_s` while they change, until stopped."""

    def __init__(self, send: ProgressSender, refit_id: str, arrived: ArrivedBytes, interval_s: float) -> None:
        self._send, self._refit_id, self._arrived = send, refit_id, arrived
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"progress-{refit_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self._interval_s + 1)

    def _run(self) -> None:
        sent: dict[tuple[int, str], int] = {}
        while not self._stop.wait(self._interval_s):
            links = self._arrived.snapshot()
            if links == sent:
                continue
            try:
                self._send(self._refit_id, links)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("syncd takes no progress reports: none sent (refit %s)", self._refit_id)
                    return
                log.debug("progress report of refit %s not taken: %s", self._refit_id, e.code())
                continue
            sent = links


def sender_of(client: object) -> ProgressSender | None:
    """The client's `report_progress` (`MemberClient`), or None for a client without one."""
    send = getattr(client, "report_progress", None)
    return send if callable(send) else None


@contextlib.contextmanager
def reporting(send: ProgressSender | None, refit_id: str, interval_s: float) -> Iterator[ArrivedBytes | None]:
    """Counts what arrives in refit `refit_id` and reports it every `interval_s` while the block
    runs; yields the counter for the receive loops, or None (nothing counted) when `send` is None
    or `interval_s` is 0."""
    if send is None or interval_s <= 0:
        yield None
        return
    arrived = ArrivedBytes()
    reporter = _Reporter(send, refit_id, arrived, interval_s)
    reporter.start()
    try:
        yield arrived
    finally:
        reporter.stop()
