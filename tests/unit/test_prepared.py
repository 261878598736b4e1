"""Prepared per-bucket work moves exactly the bytes of the unprepared path, and the decoded plan is
reused only when syncd sends the same one."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from syncd import commands
from syncd.api.convert import command_from_pb, command_to_pb
from syncd.commands import checksum_key
from syncd.layout import Canon, CanonicalTensor, Catalog, Concat, Stack, local_tensor
from syncd.layout.dtypes import torch_dtype
from syncd.member.dataplane import catalog_views, pack_into, unpack_from
from syncd.member.dataplane.checksum import Checksums
from syncd.member.dataplane.prepared import PreparedLoop
from syncd.plan import DestMember, SourceMember, make_plan

E, I, H = 4, 8, 6
GATE = CanonicalTensor("m.experts.gate_proj.weight", (E, I, H), "float32")
UP = CanonicalTensor("m.experts.up_proj.weight", (E, I, H), "float32")
NORM = CanonicalTensor("m.norm.weight", (H,), "float32")
ALL = (GATE, UP, NORM)


def _catalogs(wire_dtype: str) -> tuple[Catalog, Catalog]:
    """A trainer holding gate and up stacked ([E, 2, I, H]: each one's region is strided) and a
    receiver holding them fused ([E, 2I, H], vLLM's w13), plus a norm contiguous on both sides."""
    trainer = Catalog(
        ALL,
        (
            local_tensor(
                "w13", "float32", Stack(1, (Canon(GATE.name, GATE.shape), Canon(UP.name, UP.shape)))
            ),
            local_tensor("norm", "float32", Canon(NORM.name, NORM.shape)),
        ),
    )
    receiver = Catalog(
        tuple(replace(c, dtype=wire_dtype) for c in ALL),
        (
            local_tensor(
                "w13_weight", wire_dtype, Concat(1, (Canon(GATE.name, GATE.shape), Canon(UP.name, UP.shape)))
            ),
            local_tensor("norm", wire_dtype, Canon(NORM.name, NORM.shape)),
        ),
    )
    return trainer, receiver


def _tensors(catalog: Catalog, fill: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = {}
    for t in catalog.tensors:
        x = torch.randn(t.shape, generator=gen) if fill else torch.zeros(t.shape)
        out[t.name] = x.to(torch_dtype(t.dtype))
    return catalog_views(catalog, out)


@pytest.mark.parametrize("wire_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bucket_bytes", [64, 768, 1 << 20])  # 768: gate alone, strided in the trainer
def test_prepared_buckets_carry_the_same_bytes_and_checksums_as_packing(wire_dtype, bucket_bytes):
    trainer, receiver = _catalogs(wire_dtype)
    plan = make_plan([SourceMember("t", 0, trainer)], [DestMember("g", receiver)], bucket_bytes=bucket_bytes)
    src, dst, expected = _tensors(trainer, True), _tensors(receiver, False), _tensors(receiver, False)
    sender, receiver_loop = PreparedLoop("send"), PreparedLoop("recv")
    buf, staging = (
        torch.empty(plan.bucket_bytes + 64, dtype=torch.uint8),
        torch.empty(plan.bucket_bytes + 64, dtype=torch.uint8),
    )
    direct = 0
    for refit in range(2):  # the second refit reuses the prepared work on new values
        if refit:
            for t in src.values():
                t.add_(1)
        for bucket in plan.buckets:
            reference = pack_into(bucket, src, torch.empty(bucket.nbytes, dtype=torch.uint8)).clone()
            [sent] = sender.buckets([bucket], src, [buf[: bucket.nbytes]])
            sent.copy()
            assert torch.equal(sent.wire, reference)  # what goes on the wire, staged or direct
            direct += sent.direct is not None

            ours, theirs = Checksums(), Checksums()
            sent.checksum(ours)
            offset = 0
            for u in bucket.units:
                theirs.add(checksum_key(u.canonical, u.canon), reference[offset : offset + u.nbytes])
                offset += u.nbytes
            assert ours.result() == theirs.result()

            [arrived] = receiver_loop.buckets([bucket], dst, [staging[: bucket.nbytes]])
            arrived.wire.copy_(reference)  # the transport's part
            arrived.copy()
            unpack_from(bucket, reference, expected)
        sender.retain_used()
        receiver_loop.retain_used()
    for name in expected:
        assert torch.equal(dst[name], expected[name]), name
    # The norm is contiguous on both sides: with tiny buckets it travels alone, without staging;
    # converted or non-contiguous units never do.
    if bucket_bytes == 64 and wire_dtype == "float32":
        assert direct > 0
    if wire_dtype == "bfloat16":
        assert direct == 0


def test_the_decoded_plan_is_reused_only_for_the_same_bytes():
    trainer, receiver = _catalogs("float32")
    plans = [
        make_plan([SourceMember("t", 0, trainer)], [DestMember("g", receiver)], bucket_bytes=b)
        for b in (64, 128)
    ]

    def decoded(plan, refit_id):
        cmd = commands.ExecutePlan(refit_id, 1, plan.buckets, (), 30.0)
        return command_from_pb(command_to_pb(cmd)).buckets

    first, again = decoded(plans[0], "refit-1"), decoded(plans[0], "refit-2")
    assert first == plans[0].buckets and again is first  # same plan: the same objects
    other = decoded(plans[1], "refit-3")
    assert other == plans[1].buckets and other is not first
