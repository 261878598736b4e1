"""The relay loop in one process over a real gloo group: a chain of three replicas relays the
trainers' one copy, every replica ends bit-exact with the trainers' checksums, twice over the same
`LoopCache` (the second refit reuses the staging slots the first left, as the agent's groups do)."""

from __future__ import annotations

import numpy as np
import torch

from syncd.member.dataplane import GlooTransport, LoopCache, LoopOptions, catalog_views, send_buckets
from syncd.member.dataplane.relay import relay_buckets
from syncd.plan import DestMember, SourceMember
from syncd.plan.fanout import make_fanout_plan
from syncd.plan.simulate import materialize
from tests.unit.test_dataplane_gloo import ALL, _run_threads, trainer_catalog, vllm_catalog

REPLICAS = 3


def _refit(plan, sources, dests, transports, ranks, caches, version: int) -> None:
    """Every trainer sends and every replica relays; each replica must hold the trainers' tensors."""
    rng = np.random.default_rng(version)
    canonical = {c.name: rng.standard_normal(c.shape).astype(np.float32) for c in ALL}
    local = {
        s.member_id: {k: torch.from_numpy(v) for k, v in materialize(s.catalog, canonical).items()}
        for s in sources
    }
    received = {
        d.member_id: {t.name: torch.full(t.shape, float("nan")) for t in d.catalog.tensors} for d in dests
    }
    stats = {}
    options = LoopOptions(timeout_s=20)

    def send(s: SourceMember) -> None:
        views = catalog_views(s.catalog, local[s.member_id])
        mine = plan.for_member(s.member_id)
        stats[s.member_id] = send_buckets(
            mine, views, transports[s.member_id], ranks, options, cache=caches[s.member_id]
        )

    def relay(d: DestMember) -> None:
        views = catalog_views(d.catalog, received[d.member_id])
        mine = plan.for_member(d.member_id)
        stats[d.member_id] = relay_buckets(
            mine, d.member_id, views, transports[d.member_id], ranks, options, cache=caches[d.member_id]
        )

    errors = _run_threads([lambda s=s: send(s) for s in sources] + [lambda d=d: relay(d) for d in dests])
    assert not errors, errors
    expected = materialize(dests[0].catalog, canonical)
    sent = {k: v for s in sources for k, v in stats[s.member_id].checksums.items()}
    for d in dests:
        for name, t in received[d.member_id].items():
            assert torch.equal(t, torch.from_numpy(expected[name])), (version, d.member_id, name)
        assert stats[d.member_id].checksums == sent, (version, d.member_id)


def test_a_chain_of_relays_delivers_bit_exact_copies_on_two_refits_over_one_cache():
    sources = [
        SourceMember(f"trainer-{e * 2 + t}", 0, trainer_catalog(e, t)) for e in range(2) for t in range(2)
    ]
    dests = [DestMember(f"generator-{r}-0", vllm_catalog(0, 1)) for r in range(REPLICAS)]
    plan = make_fanout_plan(sources, dests, bucket_bytes=256)
    assert plan.relay_bytes == (REPLICAS - 1) * plan.source_bytes  # a chain: one copy per hop
    members = [m.member_id for m in sources + dests]
    ranks = {m: i for i, m in enumerate(members)}
    address, store = GlooTransport.create_address("127.0.0.1", len(members), 30)
    transports: dict[str, GlooTransport] = {}
    caches = {m: LoopCache() for m in members}

    def connect(m: str) -> None:
        transports[m] = GlooTransport.connect(
            address, ranks[m], len(members), "relay", 30, store if ranks[m] == 0 else None
        )

    assert not _run_threads([lambda m=m: connect(m) for m in members])
    try:
        for version in (1, 2):
            _refit(plan, sources, dests, transports, ranks, caches, version)
    finally:
        for t in transports.values():
            t.close()
