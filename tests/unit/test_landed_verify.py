"""Receivers verify what landed (`syncd.member.dataplane.landed`): a byte changed inside the
receiver after its bucket arrived (`landing_fault`) is caught on every refit, over a real gloo
group, whether the loop unpacks into catalog views or hands buckets to a sink."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

from syncd.layout import Canon, Catalog, local_tensor
from syncd.member.dataplane import (
    GlooTransport,
    LoopCache,
    LoopOptions,
    catalog_views,
    recv_buckets,
    send_buckets,
)
from syncd.member.dataplane.checksum import LONG_RUN_BYTES, Checksums, checksum, long_runs
from syncd.member.dataplane.landed import landed_checksums
from syncd.member.dataplane.landing_fault import LandingFault, armed
from syncd.plan import DestMember, SourceMember, make_plan
from syncd.plan.simulate import materialize
from tests.unit.test_dataplane_gloo import ALL, _Sink, vllm_catalog

REFITS = 12  # per fault: enough for the racing flip to land on both sides of the checksum worker


def test_a_changed_element_changes_the_landed_checksum_of_its_unit_only() -> None:
    catalog = vllm_catalog(0, 1)
    plan = make_plan(
        [
            SourceMember(
                "trainer-0",
                0,
                Catalog(ALL, tuple(local_tensor(c.name, "float32", Canon(c.name, c.shape)) for c in ALL)),
            )
        ],
        [DestMember("generator-0-0", vllm_catalog(0, 1))],
        bucket_bytes=1 << 20,
    )
    views = catalog_views(catalog, {t.name: torch.randn(t.shape) for t in catalog.tensors})
    units = [u for b in plan.buckets for u in b.units]
    before = landed_checksums(units, views)
    views["norm"][3] += 1
    after = landed_checksums(units, views)
    assert [k for k in before if before[k] != after[k]] == [
        k for k in before if k.startswith("m.norm.weight")
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("row", [12, 4096])
def test_a_strided_region_checksums_as_its_bytes_in_c_order(dtype: torch.dtype, row: int) -> None:
    """`Checksums.add_region`: the value of the region's contiguous bytes, whether its runs are
    short (copied together first) or long (hashed run by run where they lie, rows of 4096)."""
    whole = (torch.randn(6, 10, row) * 50).to(dtype)
    for region in (
        whole,
        whole[1:4],
        whole[:, 2:7],
        whole[2:5, 3:9, 1:11],
        whole[:, :, 4],
        whole[0:0],
        whole.transpose(0, 2),
    ):
        sums = Checksums()
        sums.add_region("r", region)
        assert sums.result()["r"] == checksum(region.contiguous()), tuple(region.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def testlong_runs_hash_where_they_lie_as_their_bytes_in_c_order(dtype: torch.dtype) -> None:
    """The landed check (`fused`) hashes a region of long runs run after run (xxh3 streams): the value of its
    contiguous bytes; regions of short runs are left to the gather."""
    whole = (torch.randn(4, 8, 1024) * 50).to(dtype)
    hashed_in_place = gathered = 0
    for region in (whole, whole[:, 2:6], whole[1:3, 1:7], whole[:, :, :512], whole[:, 3], whole[:, :, 1:]):
        runs = long_runs(region, LONG_RUN_BYTES)
        if runs is None:
            gathered += 1
            continue
        hashed_in_place += 1
        sums = Checksums()
        sums.add_pieces("r", region.numel() * region.element_size(), [r.numpy().data for r in runs])
        assert sums.result()["r"] == checksum(region.contiguous()), tuple(region.shape)
    assert hashed_in_place >= 3 and gathered >= 2


def test_an_armed_fault_names_itself_and_a_bad_file_is_refused(tmp_path) -> None:
    path = tmp_path / "fault"
    assert armed(None) is None and armed(path) is None
    path.write_text("racing\n")
    assert armed(path) == LandingFault.RACING
    path.write_text("sometimes")
    with pytest.raises(ValueError, match="holds 'sometimes'; expected one of after_checksum, racing"):
        armed(path)


@pytest.mark.parametrize("sink", [False, True], ids=["views", "sink"])
def test_a_byte_changed_after_the_bucket_checksum_is_caught_every_time(sink: bool) -> None:
    """A float32 trainer refits a 2-way TP generator's rank 0 over gloo, in 64-byte buckets, again
    and again on one group: good refits land bit-exactly and report the sender's checksums;
    every refit with a fault armed reports received checksums that differ from the sent ones
    (they are of where the units landed), which syncd's comparison refuses, naming the tensor
    and region."""
    rng = np.random.default_rng(2)
    canonical = {c.name: rng.standard_normal(c.shape).astype(np.float32) for c in ALL}
    whole = Catalog(ALL, tuple(local_tensor(c.name, "float32", Canon(c.name, c.shape)) for c in ALL))
    dest = vllm_catalog(0, 2)
    plan = make_plan(
        [SourceMember("trainer-0", 0, whole)], [DestMember("generator-0-0", dest)], bucket_bytes=64
    )
    ranks = {"trainer-0": 0, "generator-0-0": 1}
    address, store = GlooTransport.create_address("127.0.0.1", 2, 30)
    transports: dict[int, GlooTransport] = {}

    def connect(rank: int) -> None:
        transports[rank] = GlooTransport.connect(
            address, rank, 2, "g-landed", 30, store if rank == 0 else None
        )

    threads = [threading.Thread(target=connect, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    source = {k: torch.from_numpy(v) for k, v in materialize(whole, canonical).items()}
    expected = {k: torch.from_numpy(v) for k, v in materialize(dest, canonical).items()}
    caches = (LoopCache(), LoopCache())
    outcomes: dict[str, int] = {}
    for refit in range(3 * REFITS):
        fault = [None, LandingFault.AFTER_CHECKSUM, LandingFault.RACING][refit % 3]
        received = {t.name: torch.zeros(t.shape) for t in dest.tensors}
        views = catalog_views(dest, received)
        result: dict[str, Any] = {}

        def send(result: dict[str, Any] = result) -> None:
            result["sent"] = send_buckets(
                plan.for_member("trainer-0"), source, transports[0], ranks, LoopOptions(30), cache=caches[0]
            )

        def receive(result: dict[str, Any] = result, fault: LandingFault | None = fault, views=views) -> None:
            options = LoopOptions(30, landing_fault=fault)
            result["got"] = recv_buckets(
                plan.for_member("generator-0-0"),
                _Sink(views) if sink else views,
                transports[1],
                ranks,
                options,
                cache=caches[1],
            )

        threads = [threading.Thread(target=send), threading.Thread(target=receive)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
            assert not t.is_alive(), "a data-plane thread hung"
        sent = result["sent"].checksums
        got = result["got"].checksums
        assert got.keys() == sent.keys()
        if fault is None:
            assert got == sent
            assert all(torch.equal(received[k], expected[k]) for k in expected)
            outcomes["good"] = outcomes.get("good", 0) + 1
        else:
            # The receiver's checksums are of where the units landed:
            # the flipped byte, on either side of any checksum, differs from what was packed.
            assert got != sent, (fault, "a changed byte went unnoticed")
            outcomes[str(fault)] = outcomes.get(str(fault), 0) + 1
    for t in transports.values():
        t.close()
    assert outcomes == {
        "good": REFITS,
        str(LandingFault.AFTER_CHECKSUM): REFITS,
        str(LandingFault.RACING): REFITS,
    }
