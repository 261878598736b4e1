"""The undo log of in-place delta refits (`generator_svc.worker.undo_log`), without vLLM: a delta applied
through it and rolled back leaves every tensor bit-exact as it was, for sparse and dense units, in
bfloat16 and float32, and it holds memory in proportion to what changed."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest
import torch

import tests.unit.test_delta_dataplane as delta_refits
from generator_svc.worker.undo_log import UndoClosed, UndoLog
from syncd.member.dataplane.delta import recv_with_deltas
from tests.unit.test_delta_dataplane import GATE, NORM, UP, Refits


class _Sink:
    """The receiving member's tensors as an in-place receiver offers them (`DeltaSink`)."""

    def __init__(self, views: Mapping[str, torch.Tensor], undo: UndoLog) -> None:
        self.views, self.undo = views, undo

    def delta_targets(self) -> tuple[Mapping[str, torch.Tensor], UndoLog]:
        return self.views, self.undo


def _snapshot(received: dict[str, dict[str, torch.Tensor]]) -> dict[tuple[str, str], torch.Tensor]:
    return {(m, n): t.clone() for m, ts in received.items() for n, t in ts.items()}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_delta_rolled_back_restores_every_bit(dtype, monkeypatch):
    """Version 1 full; version 2 as deltas through undo logs: the gate projection moves at 1%
    (sparse units), the up projection and the norm everywhere (dense units and dense buckets,
    which the executor's own loop writes). The deltas arrive exactly; rolled back, every receiver
    holds version 1 bit for bit, and its log held no more than what changed."""
    r = Refits(dtype)
    r.refit(set())
    before = _snapshot(r.received)
    rng = np.random.default_rng(7)
    for name, fraction in ((GATE.name, 0.01), (UP.name, 1.0), (NORM.name, 1.0)):
        v = r.canonical[name]
        hit = rng.random(v.shape) < fraction
        v[hit] += np.float32(0.05) * np.sign(rng.standard_normal(hit.sum())).astype(np.float32)
    logs: dict[str, UndoLog] = {}

    def through_undo_log(buckets, views, *args, **kwargs):
        log = logs[buckets[0].dst] = UndoLog()
        return recv_with_deltas(buckets, _Sink(views, log), *args, **kwargs)

    monkeypatch.setattr(delta_refits, "recv_with_deltas", through_undo_log)
    delta = r.refit({"gen-a", "gen-b0", "gen-b1"}, base=1)
    assert r.checksums_agree(delta)
    for d in r.dests:
        for name, t in r.received[d.member_id].items():
            assert torch.equal(t, r.expected(d.member_id)[name]), (d.member_id, name)
        stats, log = delta[d.member_id], logs[d.member_id]
        itemsize = torch.finfo(getattr(torch, dtype)).bits // 8
        dense = sum(t.numel() for n, t in r.received[d.member_id].items() if n == "norm")
        dense += r.received[d.member_id]["w13_weight"].numel() // 2  # the up halves
        assert 0 < log.nbytes <= dense * itemsize + stats.changed * (8 + itemsize), (log.nbytes, stats)
        undone, overwritten = log.rollback()
        assert 0 < overwritten <= undone
    for (m, n), t in before.items():
        assert _bits_equal(r.received[m][n], t), (m, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rollback_of_regions_that_are_not_contiguous(dtype):
    """Sparse and dense saves of strided regions of one tensor, a position written twice, and
    values whose bits matter (NaN payloads, -0.0): rolled back, the tensor's bytes are unchanged;
    after the rollback the log refuses to save (a late writer must not write)."""
    g = torch.Generator().manual_seed(1)
    live = torch.randn(6, 8, 10, generator=g).to(dtype)
    live[0, 0, :3] = torch.tensor([float("nan"), -0.0, float("inf")]).to(dtype)
    before = live.clone()
    log = UndoLog()
    region = live[1:5, 2:7, 3:9]  # not contiguous
    index = torch.tensor([0, 5, 17, 119, 5], dtype=torch.int32)  # flat positions in region's C order
    log.save(region, index)
    flat = torch.arange(region.numel()).view(region.shape)
    for k in index.tolist():
        region[flat == k] = 42
    log.save(live[0, :, :4])  # dense, strided, overlapping the NaN payloads
    live[0, :, :4] = 7
    log.save(region, torch.tensor([5], dtype=torch.int32))  # written a second time
    region[flat == 5] = 9
    assert not _bits_equal(live, before)
    assert log.rollback() == (3, 3)
    assert _bits_equal(live, before)
    with pytest.raises(UndoClosed):
        log.save(region, index)


def test_discard_frees_the_old_values():
    live = torch.zeros(1000)
    log = UndoLog()
    log.save(live[10:20])
    log.save(live, torch.tensor([1, 2, 3], dtype=torch.int32))
    assert log.nbytes == 10 * 4 + 3 * (4 + 8)
    log.discard()
    assert log.nbytes == 0
    assert log.rollback() == (0, 0)
