"""The shared-memory transport over a real gloo group (threads of one process stand for the
members): a plan whose links mix shared memory and gloo is bit-exact with agreeing checksums on
two refits over one `LoopCache`, the local buckets unpacked straight from the senders' segments
(with the landed check) or copied out first; a refit's segments leave /dev/shm when it ends; the
sweep takes only a dead process's segments; a peer killed mid-refit fails the survivor and leaves
no segment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from syncd.member.dataplane import (
    GlooTransport,
    LoopCache,
    LoopOptions,
    TransferError,
    catalog_views,
    recv_buckets,
    send_buckets,
)
from syncd.member.dataplane.shm import SHM_DIR, SHM_PREFIX, ShmTransport, sweep_orphans
from syncd.plan import DestMember, SourceMember, make_plan
from syncd.plan.simulate import materialize
from tests.unit.test_dataplane_gloo import ALL, _run_threads, trainer_catalog, vllm_catalog


def _segments_of(pid: int) -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(f"{SHM_PREFIX}{pid}-*"))


def _refit(plan, sources, dests, transports, ranks, caches, version: int, landed: bool = True) -> None:
    rng = np.random.default_rng(version)
    canonical = {c.name: rng.standard_normal(c.shape).astype(np.float32) for c in ALL}
    local = {
        s.member_id: {k: torch.from_numpy(v) for k, v in materialize(s.catalog, canonical).items()}
        for s in sources
    }
    received = {
        d.member_id: {t.name: torch.full(t.shape, float("nan")) for t in d.catalog.tensors} for d in dests
    }
    stats, options = {}, LoopOptions(timeout_s=20, verify_landed=landed)

    def run(m, catalog, tensors, loop) -> None:
        views = catalog_views(catalog, tensors)
        stats[m] = loop(plan.for_member(m), views, transports[m], ranks, options, cache=caches[m])

    errors = _run_threads(
        [lambda s=s: run(s.member_id, s.catalog, local[s.member_id], send_buckets) for s in sources]
        + [lambda d=d: run(d.member_id, d.catalog, received[d.member_id], recv_buckets) for d in dests]
    )
    assert not errors, errors
    for m in ranks:  # what the agent does when its transfer ended
        transports[m].end_refit()
    sent = {k: v for s in sources for k, v in stats[s.member_id].checksums.items()}
    for d in dests:
        expected = materialize(d.catalog, canonical)
        for name, t in received[d.member_id].items():
            assert torch.equal(t, torch.from_numpy(expected[name])), (version, d.member_id, name)
        assert set(stats[d.member_id].checksums.items()) <= set(sent.items()), (version, d.member_id)


@pytest.mark.parametrize("landed", [True, False], ids=["landed-check", "wire-checksums"])
def test_a_plan_mixing_shared_memory_and_gloo_links_is_bit_exact_and_leaves_no_segments(landed: bool):
    sources = [
        SourceMember(f"trainer-{e * 2 + t}", 0, trainer_catalog(e, t)) for e in range(2) for t in range(2)
    ]
    dests = [DestMember(f"generator-0-{t}", vllm_catalog(t, 2)) for t in range(2)]
    plan = make_plan(sources, dests, bucket_bytes=256)
    members = [m.member_id for m in sources + dests]
    ranks = {m: i for i, m in enumerate(members)}
    # Hosts: trainers 0, 1 and generator-0-0 share one; trainers 2, 3 and generator-0-1 another.
    host = {m: (0 if m in ("trainer-0", "trainer-1", "generator-0-0") else 1) for m in members}
    links = {(host[b.src] == host[b.dst]) for b in plan.buckets}
    assert links == {True, False}, "the plan must have links of both kinds"
    address, store = GlooTransport.create_address("127.0.0.1", len(members), 30)
    transports: dict[str, ShmTransport] = {}
    caches: dict[str, LoopCache] = {}

    def connect(m: str) -> None:
        gloo = GlooTransport.connect(
            address, ranks[m], len(members), "mixed", 30, store if ranks[m] == 0 else None
        )
        local = [ranks[p] for p in members if p != m and host[p] == host[m]]
        transports[m] = ShmTransport(gloo, local, "mixed", 20)
        caches[m] = LoopCache(transports[m].allocate)

    assert not _run_threads([lambda m=m: connect(m) for m in members])
    try:
        for version in (1, 2):
            _refit(plan, sources, dests, transports, ranks, caches, version, landed)
            assert _segments_of(os.getpid()) == [], "a refit's segments outlive it"
        local_bytes = sum(b.nbytes for b in plan.buckets if host[b.src] == host[b.dst])
        assert sum(t.shared_bytes for t in transports.values()) == 2 * local_bytes
        # With the landed check nothing reads the arrived bytes after the unpack: unpacked where
        # they lie. With checksums of the arrived bytes instead they are copied out first.
        in_place = sum(t.read_in_place_bytes for t in transports.values())
        assert in_place == (2 * local_bytes if landed else 0)
    finally:
        for t in transports.values():
            t.close()


def test_the_sweep_unlinks_a_dead_process_segments_and_keeps_a_live_ones(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    for name in (f"{SHM_PREFIX}{dead_pid}-abc-1", f"{SHM_PREFIX}{os.getpid()}-abc-1", "other-1"):
        (tmp_path / name).write_bytes(b"x")
    assert sweep_orphans(tmp_path) == [f"{SHM_PREFIX}{dead_pid}-abc-1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-1", f"{SHM_PREFIX}{os.getpid()}-abc-1"]


def _peer(address: str, rank: int) -> subprocess.Popen:
    """tests/unit/shm_peer.py as group rank `rank`, once it moved its first bucket."""
    repo = str(Path(__file__).resolve().parents[2])
    return subprocess.Popen(
        [sys.executable, "-m", "tests.unit.shm_peer", address, str(rank)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": repo, "OMP_NUM_THREADS": "1"},
        cwd=repo,
    )


@pytest.mark.parametrize("killed", ["sender", "receiver"])
def test_a_peer_killed_mid_refit_fails_the_survivor_and_leaves_nothing_in_dev_shm(killed):
    """One bucket moves, the peer is killed (SIGKILL, its segment names still linked), the
    survivor's next transfer fails with TransferError instead of hanging, and after the survivor
    closes and sweeps (what the agent does on abort) no segment of either process is left."""
    me = 1 if killed == "sender" else 0
    address, store = GlooTransport.create_address("127.0.0.1", 2, 30)
    proc = _peer(address, 1 - me)
    try:
        transport = ShmTransport(
            GlooTransport.connect(address, me, 2, "faults", 30, store), [1 - me], "faults", 30
        )
        buf = transport.allocate(1 << 20)
        if me == 1:
            transport.irecv(buf, 0).wait(30)
            assert torch.all(buf == 7)
        else:
            transport.isend(buf, 1).wait(30)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "moved"
        assert _segments_of(proc.pid), "the peer's segments are linked while its refit runs"
        proc.kill()
        proc.wait(10)
        with pytest.raises(TransferError):
            post = transport.irecv if me == 1 else transport.isend
            post(buf, 1 - me).wait(30)
        transport.close()
        sweep_orphans()
        assert _segments_of(proc.pid) == [] and _segments_of(os.getpid()) == []
    finally:
        proc.kill()
        proc.wait(10)
