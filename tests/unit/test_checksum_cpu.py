"""CPU checksums: xxh3-64 of the packed bytes, named by their algorithm, computed off the loop."""

from __future__ import annotations

import torch
import xxhash

from syncd.member.dataplane.checksum import Checksums, DeviceSums, _format_gpu, checksum


def test_cpu_checksum_is_xxh3_of_the_bytes_and_says_so():
    x = torch.arange(1000, dtype=torch.float32)
    expected = xxhash.xxh3_64_intdigest(x.numpy().tobytes())
    assert checksum(x) == f"xxh3:{x.numel() * 4:x}:{expected:016x}"


def test_checksums_of_different_algorithms_never_compare_equal():
    """A CPU member and a GPU member (or an older build) must fail verification, not pass it."""
    x = torch.zeros(4096, dtype=torch.uint8)
    gpu = DeviceSums()
    gpu.add(x)
    assert checksum(x) != _format_gpu(x.numel(), gpu.values()[0])
    assert checksum(x).split(":")[0] != _format_gpu(x.numel(), gpu.values()[0]).split(":")[0]


def test_an_empty_and_a_one_byte_region_differ_and_keep_their_keys():
    sums = Checksums()
    sums.add("empty", torch.zeros(0, dtype=torch.uint8))
    sums.add("one", torch.zeros(1, dtype=torch.uint8))
    result = sums.result()
    assert list(result) == ["empty", "one"] and result["empty"] != result["one"]
