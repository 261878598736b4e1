"""One GPU: the executor's loops over a loop-back wire (testkit/loopback_transport.py), with the
per-bucket work captured as CUDA graphs on the first refit and replayed on later ones."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu(count=1)


def _setup():
    from syncd.member.dataplane import catalog_views
    from syncd.plan import DestMember, SourceMember, make_plan
    from testkit.loopback_transport import LoopbackWire
    from testkit.synthetic_moe import MoeShape, trainer_catalog, vllm_catalog

    # Uneven sizes on purpose: regions that are not whole 4 KiB rows, several units per bucket.
    shape = MoeShape(
        layers=2,
        hidden=200,
        experts=6,
        moe_inter=72,
        heads=5,
        kv_heads=1,
        head_dim=40,
        vocab=999,
        dtype="float32",
    )
    src_cat, dst_cat = trainer_catalog(shape, 1, 0, 1, 0), vllm_catalog(shape, 2, 1)
    plan = make_plan(
        [SourceMember("trainer-0", 0, src_cat)],
        [DestMember("generator-0-1", dst_cat)],
        bucket_bytes=256 << 10,
    )
    src = {t.name: torch.randn(t.shape, device="cuda") for t in src_cat.tensors}
    dst = {t.name: torch.full(t.shape, float("nan"), device="cuda") for t in dst_cat.tensors}
    return plan, catalog_views(src_cat, src), catalog_views(dst_cat, dst), LoopbackWire(torch.device("cuda"))


def _refit(plan, src, dst, wire, graphs: bool):
    sent, received = wire.refit(plan, ("trainer-0", src), ("generator-0-1", dst), graphs=graphs)
    return sent.checksums, received.checksums


def _expected(plan, src, dst):
    """Every destination region holds its source region's values."""
    return all(
        torch.equal(
            src[u.src_tensor][u.src_box.slices()].reshape(-1),
            dst[u.dst_tensor][u.dst_box.slices()].reshape(-1),
        )
        for b in plan.buckets
        for u in b.units
    )


def test_replayed_graphs_move_new_weights_and_checksum_them_like_eager_loops():
    plan, src, dst, wire = _setup()
    assert max(len(b.units) for b in plan.buckets) > 1
    for step in range(3):  # step 0 captures, steps 1-2 replay on weights changed in place
        for t in src.values():
            t.add_(1.0)
        sent, received = _refit(plan, src, dst, wire, graphs=True)
        assert _expected(plan, src, dst), f"step {step}: a destination region differs from its source"
        assert sent == received and len(sent) == plan.num_units
        for t in dst.values():
            t.fill_(float("nan"))
        assert _refit(plan, src, dst, wire, graphs=False) == (sent, received), "graphs changed a checksum"
        assert _expected(plan, src, dst)
