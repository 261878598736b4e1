"""The send/recv loops keep Python's cyclic garbage collector off while they run when their caller
gives them a pause (`LoopOptions.gc_pause`: a full collection stalls the host for tens of
milliseconds mid-transfer), leave it as they found it, and leave it alone without one; the loops
keep what they reuse between refits in the caller's `LoopCache`, never in the module."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from syncd.layout import Canon, CanonicalTensor, Catalog, local_tensor
from syncd.member.dataplane import GcPause, LoopCache, LoopOptions, TransferAborted, send_buckets
from syncd.plan import DestMember, SourceMember, make_plan

W = CanonicalTensor("w", (64, 8), "float32")


class _Done:
    def wait(self, timeout_s: float) -> None:
        pass

    fence = wait


class _RecordingTransport:
    """Completes every send at once and records whether the collector was on at each one."""

    rank, world_size = 0, 2

    def __init__(self, cancel_after: int | None = None, cancel: threading.Event | None = None) -> None:
        self.gc_enabled: list[bool] = []
        self._cancel_after, self._cancel = cancel_after, cancel

    def isend(self, buf: torch.Tensor, peer: int) -> _Done:
        self.gc_enabled.append(gc.isenabled())
        if self._cancel_after is not None and len(self.gc_enabled) >= self._cancel_after:
            self._cancel.set()
        return _Done()

    irecv = isend

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass


RANKS = {"trainer-0": 0, "generator-0-0": 1}


def _buckets():
    catalog = Catalog((W,), (local_tensor("w", "float32", Canon(W.name, W.shape)),))
    plan = make_plan(
        [SourceMember("trainer-0", 0, catalog)], [DestMember("generator-0-0", catalog)], bucket_bytes=512
    )
    return plan.for_member("trainer-0"), {"w": torch.randn(W.shape)}


@pytest.mark.parametrize("enabled_before", [True, False])
def test_collector_is_off_during_a_transfer_and_restored_after(enabled_before):
    buckets, tensors = _buckets()
    assert len(buckets) > 1
    transport = _RecordingTransport()
    (gc.enable if enabled_before else gc.disable)()
    try:
        send_buckets(buckets, tensors, transport, RANKS, LoopOptions(5, gc_pause=GcPause()))
        assert transport.gc_enabled == [False] * len(buckets)
        assert gc.isenabled() == enabled_before
    finally:
        gc.enable()


def test_collector_is_restored_when_a_transfer_is_aborted():
    buckets, tensors = _buckets()
    cancel = threading.Event()
    transport = _RecordingTransport(cancel_after=1, cancel=cancel)
    gc.enable()
    with pytest.raises(TransferAborted):
        send_buckets(buckets, tensors, transport, RANKS, LoopOptions(5, gc_pause=GcPause()), cancel=cancel)
    assert transport.gc_enabled == [False]
    assert gc.isenabled()


def test_without_a_pause_the_loops_leave_the_collector_alone():
    buckets, tensors = _buckets()
    transport = _RecordingTransport()
    gc.enable()
    send_buckets(buckets, tensors, transport, RANKS, LoopOptions(5))
    assert transport.gc_enabled == [True] * len(buckets)


def test_one_pause_shared_by_concurrent_holders_ends_with_the_last():
    """The agent shares one pause by all its stages: the collector comes back only after the last."""
    pause, first_in, second_out = GcPause(), threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def second() -> None:
        first_in.wait(5)
        with pause.held():
            pass
        seen["after second"] = gc.isenabled()
        second_out.set()

    gc.enable()
    t = threading.Thread(target=second)
    t.start()
    with pause.held():
        first_in.set()
        second_out.wait(5)
        seen["inside first"] = gc.isenabled()
    t.join()
    assert seen == {"after second": False, "inside first": False}
    assert gc.isenabled()


def test_the_caller_s_cache_keeps_the_staging_buffers_across_refits():
    buckets, tensors = _buckets()
    cache = LoopCache()
    send_buckets(buckets, tensors, _RecordingTransport(), RANKS, LoopOptions(5), cache=cache)
    first = [b.data_ptr() for b in cache.staging(2, max(b.nbytes for b in buckets), torch.device("cpu"))]
    send_buckets(buckets, tensors, _RecordingTransport(), RANKS, LoopOptions(5), cache=cache)
    again = [b.data_ptr() for b in cache.staging(2, max(b.nbytes for b in buckets), torch.device("cpu"))]
    assert first == again and len(set(first)) == 2


@pytest.mark.parametrize(("field", "value"), [("timeout_s", 0), ("in_flight", 0)])
def test_loop_options_refuse_values_that_cannot_work(field, value):
    kwargs = {"timeout_s": 5.0, field: value}
    with pytest.raises(ValueError, match=f"LoopOptions.{field} must be"):
        LoopOptions(**kwargs)
