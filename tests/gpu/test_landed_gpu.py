"""One GPU: the checksum kernel that reads a region where it lies (`checksum_kernel`) gives the
torch form's sums (a contiguous copy, then column and row sums) for every element size, for
strided boxes of 1-, 2- and 3-dimensional tensors, runs shorter and longer than a 4 KiB row,
regions smaller than a row and regions with bytes after their last full row; and a flipped or
moved byte changes it. The same kernel copying a region into another of other strides
(`Checksums.add_copy`) writes exactly the source's bytes and gives the same checksum."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu(count=1)

# (tensor shape, box as slices): strided boxes whose runs are shorter than a row, longer than a
# row, a prefix of rows, a single element, and whole tensors.
BOXES = [
    ((7, 9, 300), (slice(1, 6), slice(2, 5), slice(0, 100))),  # 100-element runs, dims wrap in a row
    ((7, 9, 300), (slice(1, 6), slice(2, 5), slice(None))),  # two dims merge: 900-element runs
    ((6, 768, 2048), (slice(2, 5), slice(0, 384), slice(None))),  # an expert range of a TP shard
    ((6, 2048, 768), (slice(0, 6), slice(None), slice(0, 384))),  # the other TP split
    ((4096, 2049), (slice(5, 3000), slice(1, 2048))),  # long runs at an odd offset
    ((3, 5), (slice(None), slice(None))),  # smaller than a row: only a rest
    (((1 << 20) + 7,), (slice(None),)),  # contiguous, with a rest
    ((2, 3, 4, 5), (slice(None), slice(0, 2), slice(None), slice(None))),  # collapses to 2 dims
    ((10, 5001), (slice(2, 8), slice(1, 4601))),  # long runs, not word-aligned: read by element
    ((4, 6, 3001), (slice(1, 3), slice(1, 5), slice(1, 2501))),  # the same, three dimensions
    ((4, 6, 3000), (slice(1, 3), slice(1, 5), slice(0, 2500))),  # long runs of whole words
]
DTYPES = [torch.bfloat16, torch.float32, torch.float8_e4m3fn]


def _random(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    bits = torch.randint(-(1 << 31), 1 << 31, shape, dtype=torch.int64, device="cuda")
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[torch.empty(0, dtype=dtype).element_size()]
    return bits.to(torch.int32).to(width).view(dtype)  # every bit pattern, NaNs included


def _both(region: torch.Tensor) -> tuple[str, str]:
    from syncd.member.dataplane.checksum import Checksums

    in_place, copied = Checksums(), Checksums()
    in_place.add_region("r", region)
    copied.add("r", region.contiguous().reshape(-1).view(torch.uint8))
    return in_place.result()["r"], copied.result()["r"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape, box", BOXES, ids=[str(b[0]) for b in BOXES])
def test_in_place_checksum_equals_the_copy_and_reduce_form(shape, box, dtype):
    from syncd.member.dataplane import checksum_kernel

    region = _random(shape, dtype)[box]
    assert checksum_kernel.describe(region) is not None
    got, want = _both(region)
    assert got == want


def test_many_regions_in_one_batch_and_a_changed_byte_is_seen():
    from syncd.member.dataplane.checksum import Checksums

    t = _random((600, 64, 128), torch.bfloat16)
    regions = {f"e{i}": t[i, :, 0:96] for i in range(600)}  # one launch, 600 regions
    sums = Checksums()
    for key, region in regions.items():
        sums.add_region(key, region)
    before = sums.result()
    assert len(set(before.values())) == len(regions)
    assert before == {k: _both(r)[1] for k, r in regions.items()}
    raw = t.view(torch.int16)
    raw[7, 3, 5] ^= 1  # one bit
    raw[9, 0, 0], raw[9, 0, 1] = raw[9, 0, 1].clone(), raw[9, 0, 0].clone()  # two words swapped
    after = Checksums()
    for key, region in regions.items():
        after.add_region(key, region)
    changed = {k for k, v in after.result().items() if v != before[k]}
    assert changed == {"e7", "e9"} or (changed == {"e7"} and bool(raw[9, 0, 0] == raw[9, 0, 1]))


def test_regions_read_in_place_and_copied_keep_their_order():
    """`add` (the torch form, as the wire checksums) between regions read in place (batched until
    `result`) keeps every key on its own region's checksum."""
    from syncd.member.dataplane.checksum import Checksums

    t = _random((40, 64, 128), torch.bfloat16)
    mixed, reference = Checksums(), Checksums()
    for i in range(40):
        region = t[i, :, 0:96]
        if i % 3 == 0:
            mixed.add(f"r{i}", region.contiguous().reshape(-1).view(torch.uint8))
        else:
            mixed.add_region(f"r{i}", region)
        reference.add(f"r{i}", region.contiguous().reshape(-1).view(torch.uint8))
    assert mixed.result() == reference.result()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape, box", BOXES, ids=[str(b[0]) for b in BOXES])
def test_a_copy_in_the_checksum_pass_writes_the_bytes_and_sums_them(shape, box, dtype):
    """A strided box copied into the same shape inside a wider tensor (other strides) and such a
    region copied out into a contiguous one: each destination holds its source's bits, nothing
    around it changed, and the sums are the source's."""
    from syncd.member.dataplane import checksum_kernel
    from syncd.member.dataplane.checksum import Checksums

    src = _random(shape, dtype)[box]
    n = src.shape[-1]
    wide = _random((*src.shape[:-1], n + 8), dtype)
    expected = wide.clone()
    into_wide, out_of_wide, from_wide = wide[..., 4 : 4 + n], torch.empty_like(src), expected[..., 2 : 2 + n]
    assert checksum_kernel.describe_copy(into_wide, src) is not None
    sums = Checksums()
    sums.add_copy("into wide", into_wide, src)
    sums.add_copy("out of wide", out_of_wide, from_wide)
    got = sums.result()
    assert got == {"into wide": _both(src)[1], "out of wide": _both(from_wide.clone())[1]}
    assert torch.equal(_bits(out_of_wide), _bits(from_wide))
    expected[..., 4 : 4 + n] = src
    assert torch.equal(_bits(wide), _bits(expected))


def test_a_bit_flipped_before_the_fused_unpack_changes_its_units_landed_checksum_only():
    """A bf16 trainer refits vLLM's bf16 layout on one GPU over the loop-back wire. Every unit is a
    plain copy, so each loop copies and checksums a bucket in one kernel pass (the sender its
    packed bytes, the receiver where they land). A good refit lands bit-exact with the sender's
    checksums; with a bit of an arrived bucket flipped before its unpack (`landing_fault`), the
    flip lands and the landed checksum of its unit, and of no other, differs from the sent one."""
    from syncd.member.dataplane import catalog_views
    from syncd.member.dataplane.landing_fault import LandingFault
    from syncd.plan import DestMember, SourceMember, make_plan
    from testkit.loopback_transport import LoopbackWire
    from testkit.synthetic_moe import MoeShape, trainer_catalog, vllm_catalog

    shape = MoeShape(
        layers=2, hidden=256, experts=4, moe_inter=128, heads=4, kv_heads=2, head_dim=64, vocab=512
    )
    src_cat, dst_cat = trainer_catalog(shape, 1, 0, 1, 0), vllm_catalog(shape, 1, 0)
    plan = make_plan(
        [SourceMember("trainer-0", 0, src_cat)],
        [DestMember("generator-0-0", dst_cat)],
        bucket_bytes=256 << 10,
    )
    received = sorted(plan.for_member("generator-0-0"), key=lambda b: (b.src, b.index))
    assert len(received[len(received) // 2].units) > 1  # the struck bucket goes through staging
    src = {t.name: torch.randn(t.shape, device="cuda").to(torch.bfloat16) for t in src_cat.tensors}
    wire = LoopbackWire(torch.device("cuda"))
    for fault in (None, LandingFault.AFTER_CHECKSUM, None):
        dst = {t.name: torch.zeros(t.shape, device="cuda", dtype=torch.bfloat16) for t in dst_cat.tensors}
        src_v, dst_v = catalog_views(src_cat, src), catalog_views(dst_cat, dst)
        sent, got = wire.refit(plan, ("trainer-0", src_v), ("generator-0-0", dst_v), landing_fault=fault)
        assert sent.checksums.keys() == got.checksums.keys() and len(sent.checksums) == plan.num_units
        differ = [k for k, v in sent.checksums.items() if got.checksums[k] != v]
        assert len(differ) == (0 if fault is None else 1), fault
        wrong = [
            u.canonical
            for b in plan.buckets
            for u in b.units
            if not torch.equal(
                dst_v[u.dst_tensor][u.dst_box.slices()].reshape(-1).view(torch.int16),
                src_v[u.src_tensor][u.src_box.slices()].reshape(-1).view(torch.int16),
            )
        ]
        assert len(wrong) == (0 if fault is None else 1), wrong
