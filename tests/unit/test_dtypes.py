"""Dtypes: which conversions the sender applies, the refusals (naming tensor and both dtypes, before
any byte moves), what a conversion does to the plan's bytes, and the casts themselves."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

from syncd.layout import Canon, CanonicalTensor, Catalog, Shard, Sharded, conversion, local_tensor
from syncd.layout.dtypes import CASTS, DTYPES, torch_dtype
from syncd.member.dataplane import catalog_views, pack_into, unpack_from
from syncd.plan import DestMember, SourceMember, make_plan
from syncd.plan.simulate import convert

W = CanonicalTensor("model.layers.0.mlp.experts.gate_proj.weight", (4, 6, 8), "float32")
NORM = CanonicalTensor("model.norm.weight", (8,), "float32")


def _catalog(dtype: str, tp_rank: int = 0, tp: int = 1) -> Catalog:
    """W sharded over `tp` ranks on dim 1, NORM replicated, both held in `dtype`."""
    return Catalog(
        (replace(W, dtype=dtype), replace(NORM, dtype=dtype)),
        (
            local_tensor("w", dtype, Sharded(Canon(W.name, W.shape), (Shard(1),), (tp,), (tp_rank,))),
            local_tensor("norm", dtype, Canon(NORM.name, NORM.shape)),
        ),
    )


def _trainer(dtype: str) -> list[SourceMember]:
    return [SourceMember(f"trainer-{r}", 0, _catalog(dtype, r, 2)) for r in range(2)]


def _generator(dtype: str) -> list[DestMember]:
    return [DestMember("generator-0", _catalog(dtype))]


@pytest.mark.parametrize("src, dst", sorted(CASTS | {(d, d) for d in DTYPES}))
def test_supported_conversions(src, dst):
    conv = conversion(src, dst, tensor="model.norm.weight")
    assert (conv.src, conv.dst, conv.is_identity) == (src, dst, src == dst)


@pytest.mark.parametrize(
    "src, dst",
    [
        ("float32", "float8_e4m3fn"),  # needs scales: a quantizer, not a cast
        ("bfloat16", "float8_e4m3fn"),
        ("bfloat16", "float16"),
        ("float16", "bfloat16"),
        ("float64", "float32"),
        ("float32", "float64"),
        ("float32", "int32"),
    ],
)
def test_unsupported_conversions_are_refused_naming_tensor_and_both_dtypes(src, dst):
    with pytest.raises(
        ValueError, match=rf"canonical tensor model.norm.weight: cannot convert {src} \(source\) to {dst}"
    ):
        conversion(src, dst, tensor="model.norm.weight")


def test_unknown_dtype_is_refused_with_the_known_names():
    with pytest.raises(ValueError, match=r"unknown dtype 'float31'; expected one of \[.*'bfloat16'"):
        conversion("float31", "float32", tensor="model.norm.weight")


@pytest.mark.parametrize("src, dst", [("float32", "float8_e5m2"), ("bfloat16", "float16")])
def test_planner_refuses_an_unsupported_conversion_naming_the_tensor(src, dst):
    with pytest.raises(
        ValueError, match=rf"canonical tensor {W.name}: cannot convert {src} \(source\) to {dst}"
    ):
        make_plan(_trainer(src), _generator(dst))


def test_planner_refuses_sources_that_disagree_on_a_dtype():
    mixed = [
        SourceMember("trainer-0", 0, _catalog("float32", 0, 2)),
        SourceMember("trainer-1", 0, _catalog("bfloat16", 1, 2)),
    ]
    with pytest.raises(
        ValueError,
        match=(
            rf"canonical tensor {W.name} disagrees: "
            r"trainer-0 has float32\[4, 6, 8\], trainer-1 has bfloat16"
        ),
    ):
        make_plan(mixed, _generator("float32"))


@pytest.mark.parametrize("wire", ["bfloat16", "float16"])
def test_float32_to_16_bit_plan_moves_half_the_bytes_and_records_the_conversion(wire):
    same = make_plan(_trainer("float32"), _generator("float32"))
    converted = make_plan(_trainer("float32"), _generator(wire))
    assert same.total_bytes == W.nbytes + NORM.nbytes
    assert converted.total_bytes * 2 == same.total_bytes
    units = [u for b in converted.buckets for u in b.units]
    assert {(u.src_dtype, u.dtype) for u in units} == {("float32", wire)}
    assert {(u.src_dtype, u.dtype) for b in same.buckets for u in b.units} == {(None, "float32")}


def test_bfloat16_to_float32_plan_moves_twice_the_bytes():
    assert (
        make_plan(_trainer("bfloat16"), _generator("float32")).total_bytes
        == 2 * make_plan(_trainer("bfloat16"), _generator("bfloat16")).total_bytes
    )


def test_sender_packs_the_destination_dtype_and_the_receiver_gets_torchs_cast():
    """In-process: pack from a float32 trainer rank, unpack into a bfloat16 generator tensor."""
    plan = make_plan(_trainer("float32"), _generator("bfloat16"), bucket_bytes=40)
    full = {
        W.name: torch.randn(W.shape, generator=torch.Generator().manual_seed(0)),
        NORM.name: torch.randn(NORM.shape),
    }
    full[W.name].view(-1)[:4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 3.4e38, -0.0])  # ties, overflow
    sources = {
        m.member_id: catalog_views(
            m.catalog, {"w": full[W.name][:, r * 3 : (r + 1) * 3].contiguous(), "norm": full[NORM.name]}
        )
        for r, m in enumerate(_trainer("float32"))
    }
    received = {
        "w": torch.zeros(W.shape, dtype=torch.bfloat16),
        "norm": torch.zeros(NORM.shape, dtype=torch.bfloat16),
    }
    buffer = torch.empty(40, dtype=torch.uint8)
    for bucket in plan.buckets:
        flat = pack_into(bucket, sources[bucket.src], buffer)
        assert flat.numel() == bucket.nbytes
        unpack_from(bucket, flat, received)
    assert torch.equal(received["w"].view(torch.int16), full[W.name].to(torch.bfloat16).view(torch.int16))
    assert torch.equal(
        received["norm"].view(torch.int16), full[NORM.name].to(torch.bfloat16).view(torch.int16)
    )


def _random_float32_bits(n: int) -> np.ndarray:
    """Uniformly random bit patterns (every class: NaNs, infinities, subnormals), half of them made
    exact bfloat16 ties, where round-to-nearest-even matters."""
    bits = np.random.default_rng(7).integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    bits[::2] = (bits[::2] & 0xFFFF0000) | 0x8000
    return bits.view(np.float32)


def _same_bits_or_both_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(ints), b[~nan].view(ints)))


@pytest.mark.parametrize("src, dst", sorted(CASTS))
def test_numpy_reference_casts_equal_torch(src, dst):
    """The NumPy reference (used by the property tests) equals torch's `.to()` on every bfloat16
    and float16 pattern, and on random float32 patterns with many ties (NaN payloads aside)."""
    if src == "float32":
        x = torch.from_numpy(_random_float32_bits(1 << 18))
    else:
        x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch_dtype(src))
    held = x.view(torch.int16).numpy().view(np.uint16) if src == "bfloat16" else x.numpy()
    ref = convert(held, src, dst)
    ref = (
        torch.from_numpy(ref.view(np.int16)).view(torch.bfloat16)
        if dst == "bfloat16"
        else torch.from_numpy(ref)
    )
    assert _same_bits_or_both_nan(ref, x.to(torch_dtype(dst)))


def test_the_control_plane_imports_dtypes_without_torch():
    code = "import sys, syncd.layout, syncd.plan; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
