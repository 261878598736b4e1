"""The gloo data plane moves planned buckets bit-exactly, checksums agree, and nothing hangs."""

from __future__ import annotations

import gc
import threading
from dataclasses import replace

import numpy as np
import pytest
import torch

from syncd.layout import (
    Canon,
    CanonicalTensor,
    Catalog,
    Concat,
    Replicate,
    Shard,
    Sharded,
    Stack,
    local_tensor,
)
from syncd.layout.dtypes import torch_dtype
from syncd.member.agent.progress import ArrivedBytes
from syncd.member.dataplane import (
    GlooTransport,
    LoopOptions,
    TransferError,
    TransferTimeout,
    catalog_views,
    recv_buckets,
    send_buckets,
    unpack_from,
)
from syncd.member.dataplane.landed import landed_checksums
from syncd.plan import DestMember, SourceMember, make_plan
from syncd.plan.simulate import materialize

E, I, H = 4, 8, 6
GATE = CanonicalTensor("m.experts.gate_proj.weight", (E, I, H), "float32")
UP = CanonicalTensor("m.experts.up_proj.weight", (E, I, H), "float32")
NORM = CanonicalTensor("m.norm.weight", (H,), "float32")
ALL = (GATE, UP, NORM)


def trainer_catalog(ep_rank: int, tp_rank: int, dtype: str = "float32") -> Catalog:
    fused = Stack(1, (Canon(GATE.name, GATE.shape), Canon(UP.name, UP.shape)))
    return Catalog(
        tuple(replace(c, dtype=dtype) for c in ALL),
        (
            local_tensor("w13", dtype, Sharded(fused, (Shard(0), Shard(2)), (2, 2), (ep_rank, tp_rank))),
            local_tensor("norm", dtype, Canon(NORM.name, NORM.shape)),
        ),
    )


def vllm_catalog(tp_rank: int, tp: int, dtype: str = "float32") -> Catalog:
    parts = tuple(Sharded(Canon(c.name, c.shape), (Shard(1),), (tp,), (tp_rank,)) for c in (GATE, UP))
    return Catalog(
        tuple(replace(c, dtype=dtype) for c in ALL),
        (
            local_tensor("w13_weight", dtype, Concat(1, parts)),
            local_tensor(
                "norm", dtype, Sharded(Canon(NORM.name, NORM.shape), (Replicate(),), (tp,), (tp_rank,))
            ),
        ),
    )


def _run_threads(fns):
    errors, threads = [], []
    for fn in fns:

        def target(fn=fn):
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - re-raised by the caller after the joins
                errors.append(e)

        threads.append(threading.Thread(target=target))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a data-plane thread hung"
    return errors


class _Sink:
    """A receiver that takes whole buckets (as the generator's in-place install does)."""

    def __init__(self, views) -> None:
        self.views, self.device, self.buckets = views, torch.device("cpu"), 0
        self.units: list = []

    def unpack(self, bucket, flat) -> None:
        unpack_from(bucket, flat, self.views)
        self.buckets += 1
        self.units.extend(bucket.units)

    def landed(self) -> dict[str, str]:
        return landed_checksums(self.units, self.views)

    def position(self, bucket) -> tuple:
        return (-bucket.index,)  # asks for the links' last buckets first: each link's order is kept


@pytest.mark.parametrize("sink", [False, True], ids=["views", "sink"])
@pytest.mark.parametrize("wire_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bucket_bytes", [64, 1 << 20])
def test_gloo_refit_is_bit_exact_and_checksums_agree(bucket_bytes, wire_dtype, sink):
    """A float32 trainer refits a float32 or a bfloat16 generator: the sender casts while packing,
    so the generator holds exactly torch's cast of the trainer's weights; a receiver that takes
    whole buckets itself (`ReceiveSink`) gets every bucket once and checksums the same bytes; each
    receiver counts every byte of each link into it as it arrives (progress reports)."""
    rng = np.random.default_rng(1)
    canonical = {c.name: rng.standard_normal(c.shape).astype(np.float32) for c in ALL}
    sources = [
        SourceMember(f"trainer-{e * 2 + t}", 0, trainer_catalog(e, t)) for e in range(2) for t in range(2)
    ]
    dests = [DestMember(f"generator-0-{t}", vllm_catalog(t, 2, wire_dtype)) for t in range(2)]
    plan = make_plan(sources, dests, bucket_bytes=bucket_bytes)
    members = [m.member_id for m in sources + dests]
    ranks = {m: i for i, m in enumerate(members)}
    address, store = GlooTransport.create_address("127.0.0.1", len(members), 30)
    local = {
        m.member_id: {k: torch.from_numpy(v) for k, v in materialize(m.catalog, canonical).items()}
        for m in sources
    }
    wire = torch_dtype(wire_dtype)
    received = {
        m.member_id: {t.name: torch.full(t.shape, float("nan"), dtype=wire) for t in m.catalog.tensors}
        for m in dests
    }
    stats, sinks = {}, {}
    arrived = {m.member_id: ArrivedBytes() for m in dests}

    def member(m, catalog, sending):
        transport = GlooTransport.connect(
            address, ranks[m], len(members), "g0", 30, store if ranks[m] == 0 else None
        )
        views = catalog_views(catalog, local[m] if sending else received[m])
        if sink and not sending:
            views = sinks[m] = _Sink(views)
        run = send_buckets if sending else recv_buckets
        counter = None if sending else arrived[m].add
        stats[m] = run(plan.for_member(m), views, transport, ranks, LoopOptions(30, on_received=counter))

    errors = _run_threads(
        [lambda m=m: member(m.member_id, m.catalog, True) for m in sources]
        + [lambda m=m: member(m.member_id, m.catalog, False) for m in dests]
    )
    assert not errors, errors
    for m in dests:
        expected = materialize(m.catalog, canonical)
        for name, t in received[m.member_id].items():
            assert torch.equal(t, torch.from_numpy(expected[name]).to(wire)), name  # no NaN left: all written
    sent = {k: v for s in sources for k, v in stats[s.member_id].checksums.items()}
    got = {k: v for d in dests for k, v in stats[d.member_id].checksums.items()}
    assert got and sent == got
    assert sum(stats[d.member_id].bytes for d in dests) == sum(m.catalog.nbytes for m in dests)
    if sink:
        assert sum(s.buckets for s in sinks.values()) == len(plan.buckets)
    for d in dests:
        links = {(k.stage, k.src): k.bytes for k in plan.links() if k.dst == d.member_id}
        assert arrived[d.member_id].snapshot() == links


@pytest.mark.parametrize("sender_dies", [False, True])
def test_receiver_fails_cleanly_instead_of_hanging_when_the_sender_never_sends(sender_dies):
    sources = [
        SourceMember(
            "trainer-0",
            0,
            Catalog(ALL, tuple(local_tensor(c.name, "float32", Canon(c.name, c.shape)) for c in ALL)),
        )
    ]
    dests = [DestMember("generator-0-0", vllm_catalog(0, 1))]
    plan = make_plan(sources, dests)
    ranks = {"trainer-0": 0, "generator-0-0": 1}
    address, store = GlooTransport.create_address("127.0.0.1", 2, 30)
    done, outcome = threading.Event(), {}

    def silent_sender():
        transport = GlooTransport.connect(address, 0, 2, "g1", 30, store)  # joins, never sends
        if sender_dies:
            transport.close()
            del transport
            gc.collect()
        done.wait(30)

    def receiver():
        transport = GlooTransport.connect(address, 1, 2, "g1", 30)
        views = {t.name: torch.zeros(t.shape) for t in dests[0].catalog.tensors}
        expected = (
            (TransferError, "failed") if sender_dies else (TransferTimeout, "did not complete within 2 s")
        )
        try:
            with pytest.raises(expected[0], match=expected[1]):
                recv_buckets(
                    plan.for_member("generator-0-0"), views, transport, ranks, LoopOptions(timeout_s=2)
                )
            outcome["clean_error"] = True
        finally:
            done.set()

    errors = _run_threads([silent_sender, receiver])
    assert not errors, errors
    assert outcome == {"clean_error": True}


def test_checksum_catches_a_flipped_or_swapped_word():
    from syncd.member.dataplane import checksum

    x = torch.arange(64, dtype=torch.float32)
    flipped, swapped = x.clone(), x.clone()
    flipped.view(torch.int32)[10] ^= 1
    swapped[[3, 4]] = swapped[[4, 3]]
    assert len({checksum(x), checksum(flipped), checksum(swapped)}) == 3
    assert checksum(x) == checksum(x.clone())


def test_gpu_checksum_algorithm_catches_corruption_and_misplacement():
    """The GPU algorithm is plain torch: exercise it on CPU tensors of awkward sizes."""
    from syncd.member.dataplane.checksum import DeviceSums

    for n in (9, 4096 * 3 + 6, 1024 * 40 + 3):  # tail-only, rows + tail, many rows + tail
        x = torch.randint(0, 256, (n,), dtype=torch.uint8)
        x[0], x[4] = 1, 2  # two different 32-bit words to swap
        flipped, swapped = x.clone(), x.clone()
        flipped[n // 2] ^= 1
        swapped[0:4], swapped[4:8] = x[4:8].clone(), x[0:4].clone()
        sums = DeviceSums()
        for t in (x, flipped, swapped, x.clone()):
            sums.add(t)
        values = sums.values()
        assert len(set(values[:3])) == 3 and values[3] == values[0]


def test_gpu_checksum_batched_fold_equals_the_per_region_definition():
    """`values()` folds all regions at once; each must equal the definition applied to it alone:
    weighted int32 column sums, weighted int32 row sums of [rows, 1024] words, weighted rest."""
    from syncd.member.dataplane.checksum import DeviceSums

    def wrap32(v):
        return (v + 2**31) % 2**32 - 2**31

    def wrap64(v):  # the int64 sums' bits, as `values()` gives them: unsigned
        return v % 2**64

    def reference(b: torch.Tensor):
        n = b.numel()
        full = n - n % 4096
        m = b[:full].view(torch.int32).view(-1, 1024).to(torch.int64)
        col = sum((i + 1) * wrap32(int(v)) for i, v in enumerate(m.sum(0).tolist()))
        row = sum((i + 1) * wrap32(int(v)) for i, v in enumerate(m.sum(1).tolist()))
        tail = b[full:]
        words = (
            tail[: tail.numel() - tail.numel() % 4].view(torch.int32).tolist() if tail.numel() >= 4 else []
        )
        rest = words + tail[len(words) * 4 :].tolist()
        return wrap64(col), wrap64(row), wrap64(sum((i + 1) * v for i, v in enumerate(rest)))

    gen = torch.Generator().manual_seed(3)
    sizes = [0, 3, 4096, 4096 * 5 + 1, 7, 4096 * 17 + 4095, 8]
    regions = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in sizes]
    regions[2].fill_(255)  # all -1 words: the sums wrap
    sums = DeviceSums()
    for r in regions:
        sums.add(r)
    assert sums.values() == [reference(r) for r in regions]


def test_gloo_refuses_a_tensor_off_the_host_by_name():
    """Inside vLLM's layerwise reload a model's parameters are on the meta device; gloo given one
    resets the connection and the peers see only a broken transfer."""
    address, store = GlooTransport.create_address("127.0.0.1", 1, 30)
    transport = GlooTransport.connect(address, 0, 1, "meta-refusal", 30, store=store)
    try:
        for call, what in ((transport.irecv, "receive into"), (transport.isend, "send from")):
            with pytest.raises(ValueError, match=f"gloo cannot {what} a tensor on the meta device"):
                call(torch.empty(8, dtype=torch.uint8, device="meta"), 0)
    finally:
        transport.close()


def test_closing_a_group_fails_a_peers_pending_send_while_our_handles_live_on():
    """An aborted receiver closes its group while its failed loop's traceback still holds the
    handles it posted. Its peer, blocked sending to it, must fail now: gloo's abort alone leaves
    it waiting out its whole timeout (and the next refit's group waits behind it)."""
    address, store = GlooTransport.create_address("127.0.0.1", 2, 30)
    joined, closed, sent = threading.Barrier(2), threading.Event(), threading.Event()
    outcome = {}

    def sender():
        transport = GlooTransport.connect(address, 0, 2, "g2", 30, store)
        joined.wait(30)
        handle = transport.isend(torch.zeros(5, dtype=torch.uint8), 1)
        closed.wait(30)
        try:
            with pytest.raises(TransferError) as failed:
                handle.wait(20)
            outcome["timed_out"] = isinstance(failed.value, TransferTimeout)
        finally:
            sent.set()
            transport.close()

    def receiver():
        transport = GlooTransport.connect(address, 1, 2, "g2", 30)
        joined.wait(30)
        held = transport.irecv(torch.zeros(5, dtype=torch.uint8), 0, tag=7)  # not the send's tag
        transport.close()
        closed.set()
        sent.wait(30)  # the handle stays alive until the sender knows
        with pytest.raises(TransferError, match="closed"):
            held.wait(1)

    errors = _run_threads([sender, receiver])
    assert not errors, errors
    assert outcome == {"timed_out": False}


def test_an_abort_ends_a_blocked_send_and_a_blocked_receive_at_once():
    """A member whose peer is cut off (alive, silent) blocks in a send that nobody takes and a
    receive that nothing fills. syncd's Abort closes its groups (`MemberAgent`): both must end
    within seconds, not at the stall timeout, so the member is free for the next refit's group."""
    address, store = GlooTransport.create_address("127.0.0.1", 2, 30)
    joined, released = threading.Barrier(2), threading.Event()
    ended: dict[str, BaseException] = {}

    def cut_off_peer():
        transport = GlooTransport.connect(address, 1, 2, "cut", 30)
        joined.wait(30)
        released.wait(60)  # never sends nor receives
        transport.close()

    def member():
        transport = GlooTransport.connect(address, 0, 2, "cut", 30, store)
        joined.wait(30)
        sending = transport.isend(torch.zeros(64 << 20, dtype=torch.uint8), 1)
        receiving = transport.irecv(torch.zeros(1 << 20, dtype=torch.uint8), 1)
        waits = [
            threading.Thread(target=_ended_by, args=(handle, what, ended))
            for what, handle in (("send", sending), ("receive", receiving))
        ]
        for t in waits:
            t.start()
        transport.close()  # what the agent does with every group on Abort
        try:
            for t in waits:
                t.join(5)
                assert not t.is_alive(), "a transfer outlived the abort by 5 s"
        finally:
            released.set()

    errors = _run_threads([cut_off_peer, member])
    assert not errors, errors
    assert sorted(ended) == ["receive", "send"]
    for what, error in ended.items():
        assert isinstance(error, TransferError) and not isinstance(error, TransferTimeout), (what, error)
        assert "the group was aborted" in str(error), (what, error)


def _ended_by(handle, what: str, ended: dict[str, BaseException]) -> None:
    """Wait for `handle` far longer than the test allows the abort; note what ended it."""
    try:
        handle.wait(120)
    except BaseException as e:  # noqa: BLE001 - the test reads it
        ended[what] = e
