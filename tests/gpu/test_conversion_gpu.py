"""One GPU: a float32 trainer refits a bfloat16 generator through the executor's loops (eager and
CUDA graphs); the sender's cast on the GPU is torch's CPU cast bit for bit; the FP8 reference
quantizer gives the same bytes on the GPU as on the CPU, and so does a bfloat16 trainer's refit of
a blockwise-FP8 generator, quantized while packing."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.gpu(count=1)


def _refit(plan, src, dst, wire, graphs: bool):
    return wire.refit(plan, ("trainer-0", src), ("generator-0-1", dst), graphs=graphs)


@pytest.mark.parametrize("graphs", [False, True])
def test_float32_trainer_refits_bfloat16_generator_with_torchs_cpu_cast(graphs):
    from syncd.member.dataplane import catalog_views
    from syncd.plan import DestMember, SourceMember, make_plan
    from testkit.loopback_transport import LoopbackWire
    from testkit.synthetic_moe import MoeShape, trainer_catalog, vllm_catalog

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
    src_cat, dst_cat = (
        trainer_catalog(shape, 1, 0, 1, 0),
        vllm_catalog(replace(shape, dtype="bfloat16"), 2, 1),
    )
    plan = make_plan(
        [SourceMember("trainer-0", 0, src_cat)],
        [DestMember("generator-0-1", dst_cat)],
        bucket_bytes=256 << 10,
    )
    src = {t.name: torch.randn(t.shape, device="cuda") for t in src_cat.tensors}
    for t in src.values():  # bfloat16 ties (to even: down, up) and overflow to infinity
        t.view(-1)[:3] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 3.4e38])
    dst = {
        t.name: torch.full(t.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
        for t in dst_cat.tensors
    }
    sent, received = _refit(
        plan,
        catalog_views(src_cat, src),
        catalog_views(dst_cat, dst),
        LoopbackWire(torch.device("cuda")),
        graphs,
    )
    assert sent.checksums == received.checksums and len(sent.checksums) == plan.num_units
    assert received.bytes == plan.total_bytes == dst_cat.nbytes
    src_v, dst_v = catalog_views(src_cat, src), catalog_views(dst_cat, dst)
    for b in plan.buckets:
        for u in b.units:
            # Flat: a unit's two boxes have the same elements in the same order, not always the
            # same shape (the trainer's fused gate/up is registered in a view shape).
            want = src_v[u.src_tensor][u.src_box.slices()].cpu().to(torch.bfloat16).reshape(-1)
            got = dst_v[u.dst_tensor][u.dst_box.slices()].cpu().reshape(-1)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), u.canonical


def test_fp8_quantizer_gives_the_same_bytes_on_gpu_and_cpu():
    from syncd.member.dataplane.fp8 import quantize_blockwise

    x = torch.randn(3, 300, 200) * torch.logspace(-3, 1, 300).view(-1, 1)
    q_cpu, s_cpu = quantize_blockwise(x)
    q_gpu, s_gpu = quantize_blockwise(x.cuda())
    assert torch.equal(s_gpu.cpu(), s_cpu)
    assert torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8))


@pytest.mark.parametrize("graphs", [False, True])
def test_bfloat16_trainer_refits_an_fp8_generator_with_the_cpu_quantizers_bytes(graphs):
    """The sender quantizes on the GPU while packing (eager and in CUDA graphs, where a captured
    pack replays on the weights of the moment): what lands equals the CPU quantizer's bytes."""
    from syncd.layout.dtypes import torch_dtype
    from syncd.member.dataplane import catalog_views
    from syncd.member.dataplane.fp8 import quantize_blockwise
    from syncd.plan import DestMember, SourceMember, make_plan
    from syncd.plan.fp8_blocks import blockwise_fp8_catalog, to_grid
    from testkit.loopback_transport import LoopbackWire
    from testkit.synthetic_moe import MoeShape, trainer_catalog, vllm_catalog

    shape = MoeShape(
        layers=2, hidden=200, experts=6, moe_inter=256, heads=4, kv_heads=2, head_dim=128, vocab=999
    )
    src_cat, dst_cat = trainer_catalog(shape, 1, 0, 1, 0), blockwise_fp8_catalog(vllm_catalog(shape, 2, 1))
    plan = make_plan(
        [SourceMember("trainer-0", 0, src_cat)], [DestMember("generator-0-1", dst_cat)], bucket_bytes=96 << 10
    )
    assert {u.quantized for b in plan.buckets for u in b.units} >= {"values", "scales"}
    src = {t.name: torch.randn(t.shape, device="cuda").to(torch.bfloat16) for t in src_cat.tensors}
    dst = {t.name: torch.zeros(t.shape, device="cuda", dtype=torch_dtype(t.dtype)) for t in dst_cat.tensors}
    wire = LoopbackWire(torch.device("cuda"))
    for _ in range(2):  # the second refit replays on new weights
        for t in src.values():
            t.normal_()
        sent, received = _refit(plan, catalog_views(src_cat, src), catalog_views(dst_cat, dst), wire, graphs)
        assert sent.checksums == received.checksums and len(sent.checksums) == plan.num_units
        src_v, dst_v = catalog_views(src_cat, src), catalog_views(dst_cat, dst)
        for b in plan.buckets:
            for u in b.units:
                got = dst_v[u.dst_tensor][u.dst_box.slices()].cpu().reshape(-1)
                region = src_v[u.src_tensor][u.src_box.slices()].cpu()
                if u.quantized:
                    values, scales = quantize_blockwise(region.reshape(u.block_box.shape))
                    whole = values if u.quantized == "values" else scales
                    origin = (u.block_box if u.quantized == "values" else to_grid(u.block_box)).start
                    take = tuple(slice(a - o, b - o) for a, b, o in zip(u.canon.start, u.canon.stop, origin))
                    want = whole[take].reshape(-1)
                else:
                    want = region.reshape(-1)
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), u.canonical


@pytest.mark.parametrize(
    "shape, cut",
    [
        ((300, 200), None),
        ((3, 256, 200), (slice(None), slice(None), slice(0, 200))),
        ((2, 384, 640), (slice(None), slice(128, 384), slice(128, 512))),
    ],
    ids=["edge-blocks", "experts", "strided-region"],
)
def test_the_fused_fp8_kernel_writes_the_cpu_quantizers_bytes(shape, cut):
    from syncd.member.dataplane import fp8_kernel
    from syncd.member.dataplane.fp8 import quantize_blockwise
    from syncd.plan.fp8_blocks import scale_shape

    whole = (torch.randn(shape) * torch.logspace(-4, 2, shape[-2]).view(-1, 1)).to(torch.bfloat16)
    whole.view(-1)[:3] = torch.tensor([0.0, -0.0, 1e-30])
    x = whole.cuda() if cut is None else whole.cuda()[cut]  # sliced on the GPU: strided
    assert fp8_kernel.available(x) and x.is_contiguous() == (cut is None or shape[-1] == 200)
    values = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device="cuda")
    scales = torch.empty(scale_shape(tuple(x.shape)), device="cuda")
    fp8_kernel.quantize_into(x, values, scales)
    want_values, want_scales = quantize_blockwise(x.cpu())
    assert torch.equal(scales.cpu(), want_scales)
    assert torch.equal(values.cpu().view(torch.uint8), want_values.view(torch.uint8))
    only = torch.empty_like(scales)
    fp8_kernel.quantize_into(x, None, only)
    assert torch.equal(only, scales)
