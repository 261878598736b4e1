"""The send/recv loops keep Python's cyclic garbage collector off while they run (a full collection
stalls the host for tens of milliseconds mid-transfer) and leave it as they found it."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from syncd.layout import Canon, CanonicalTensor, Catalog, local_tensor
from syncd.member.dataplane import TransferAborted, send_buckets
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
        send_buckets(buckets, tensors, transport, {"trainer-0": 0, "generator-0-0": 1}, timeout_s=5)
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
        send_buckets(
            buckets, tensors, transport, {"trainer-0": 0, "generator-0-0": 1}, timeout_s=5, cancel=cancel
        )
    assert transport.gc_enabled == [False]
    assert gc.isenabled()
