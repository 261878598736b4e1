"""Delta links through relays (fan-out) on the gloo data plane, real threads in one process: a
chain of three bfloat16 replicas takes version 1 full and version 2 as the trainers' deltas, each
relay forwarding them as they came (sparse buckets in the message, dense ones through the bucket
forwarder); every replica ends bit-exact and its whole-region checksums equal the trainers'. A
replica whose base differs is caught by its own checksums, not its relay's."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from syncd.commands import DeltaLinks
from syncd.layout.dtypes import torch_dtype
from syncd.member.dataplane import GlooTransport, LoopOptions, TransferStats, catalog_views, recv_buckets
from syncd.member.dataplane.delta import Diffs, Mirror, recv_with_deltas, send_with_deltas
from syncd.member.dataplane.relay import relay_buckets, relay_with_deltas
from syncd.plan import DestMember, SourceMember
from syncd.plan.fanout import make_fanout_plan, received_bytes
from syncd.plan.simulate import materialize
from tests.unit.test_dataplane_gloo import _run_threads
from tests.unit.test_delta_dataplane import ALL, GATE, trainer_catalog, vllm_catalog

REPLICAS = 3
DTYPE = "bfloat16"
_GROUPS = itertools.count()


class Chain:
    """Four float32 trainer ranks and a chain of `REPLICAS` bfloat16 TP-1 replicas."""

    def __init__(self) -> None:
        self.sources = [
            SourceMember(f"trainer-{e * 2 + t}", 0, trainer_catalog(e, t)) for e in range(2) for t in range(2)
        ]
        self.dests = [DestMember(f"gen-{r}", vllm_catalog(0, 1, DTYPE)) for r in range(REPLICAS)]
        self.plan = make_fanout_plan(self.sources, self.dests, bucket_bytes=8 << 10)
        assert self.plan.relay_bytes == (REPLICAS - 1) * self.plan.source_bytes  # a chain
        self.mirrors = {s.member_id: Mirror() for s in self.sources}
        rng = np.random.default_rng(0)
        self.canonical = {c.name: (rng.standard_normal(c.shape) * 0.02).astype(np.float32) for c in ALL}
        self.received = {
            d.member_id: {t.name: torch.zeros(t.shape, dtype=torch_dtype(DTYPE)) for t in d.catalog.tensors}
            for d in self.dests
        }

    def refit(self, delta: bool) -> dict[str, TransferStats]:
        """One transfer over a fresh gloo group; `delta`: every replica holds version 1, the base."""
        members = [m.member_id for m in self.sources + self.dests]
        ranks = {m: i for i, m in enumerate(members)}
        links = DeltaLinks(1, frozenset(d.member_id for d in self.dests), 0.5) if delta else None
        address, store = GlooTransport.create_address("127.0.0.1", len(members), 30)
        group, stats = f"delta-relay{next(_GROUPS)}", {}
        options = LoopOptions(30)

        def member(m: str, catalog, sending: bool) -> None:
            transport = GlooTransport.connect(
                address, ranks[m], len(members), group, 30, store if ranks[m] == 0 else None
            )
            mine = self.plan.for_member(m)
            relaying = any(b.src == m for b in mine)
            try:
                if sending:
                    local = {
                        k: torch.from_numpy(v.copy()) for k, v in materialize(catalog, self.canonical).items()
                    }
                    views = catalog_views(catalog, local)
                    diffs = Diffs(self.mirrors[m])
                    sender_links = links or DeltaLinks(None, frozenset(), 0.5)  # full: mirrors fill
                    stats[m] = send_with_deltas(mine, views, transport, ranks, sender_links, diffs, options)
                    diffs.commit(views)  # as the agent does once all its stages succeeded
                    return
                views = catalog_views(catalog, self.received[m])
                if links is None and relaying:
                    stats[m] = relay_buckets(mine, m, views, transport, ranks, options)
                elif links is None:
                    stats[m] = recv_buckets(mine, views, transport, ranks, options)
                elif relaying:
                    stats[m] = relay_with_deltas(mine, m, views, transport, ranks, links, options)
                else:
                    stats[m] = recv_with_deltas(mine, views, transport, ranks, links, options)
            finally:
                transport.close()

        errors = _run_threads(
            [lambda s=s: member(s.member_id, s.catalog, True) for s in self.sources]
            + [lambda d=d: member(d.member_id, d.catalog, False) for d in self.dests]
        )
        assert not errors, errors
        return stats

    def expected(self) -> dict[str, torch.Tensor]:
        return {
            k: torch.from_numpy(v).to(torch_dtype(DTYPE))
            for k, v in materialize(self.dests[0].catalog, self.canonical).items()
        }

    def differing(self) -> list[tuple[str, str]]:
        """(replica, tensor) of every received tensor whose bits are not the export's."""
        expected = self.expected()
        return [
            (d.member_id, name)
            for d in self.dests
            for name, t in self.received[d.member_id].items()
            if not torch.equal(t, expected[name])
        ]

    def mismatched(self, stats) -> dict[str, list[str]]:
        """Per replica, the checksum keys that differ from the trainers'."""
        sent = {k: v for s in self.sources for k, v in stats[s.member_id].checksums.items()}
        return {
            d.member_id: sorted(k for k, v in stats[d.member_id].checksums.items() if sent[k] != v)
            for d in self.dests
        }

    def step(self, fraction: float, heavy: tuple[str, ...] = ()) -> None:
        """`fraction` of every tensor's elements move, 40% of those named in `heavy` (their buckets
        then go dense: their delta would cost more than half their bytes)."""
        rng = np.random.default_rng(len(heavy) + int(fraction * 1e6))
        for name, v in self.canonical.items():
            hit = rng.random(v.shape) < (0.4 if name in heavy else fraction)
            v[hit] += np.float32(0.05) * np.sign(rng.standard_normal(hit.sum())).astype(np.float32)


def test_a_delta_through_a_chain_of_relays_leaves_every_replica_bit_exact():
    """Version 2 changes 1% of everything and 40% of one expert projection: its buckets go dense
    through the relays' bucket forwarders, the rest as the trainers' sparse messages."""
    c = Chain()
    full = c.refit(delta=False)
    assert not any(c.mismatched(full).values())
    c.step(0.01, heavy=(GATE.name,))
    delta = c.refit(delta=True)
    assert not any(c.mismatched(delta).values()), c.mismatched(delta)
    assert not c.differing(), c.differing()
    # Every replica received the same delta: the heavy half dense, the rest sparse.
    last = c.dests[-1].member_id
    reported = {d.member_id: delta[d.member_id].bytes for d in c.dests}
    assert 0.4 * full[last].bytes < reported[last] < 0.75 * full[last].bytes, reported
    assert received_bytes(c.plan, reported) == REPLICAS * reported[last]  # relays forward as it came
    assert all(delta[d.member_id].changed == delta[last].changed > 0 for d in c.dests)


def test_a_replica_on_another_base_fails_its_own_checksums_behind_a_relay():
    """One element of the last replica's base flipped by hand: the relays forward and verify
    clean; the last replica applies the same delta and its whole-region checksum differs."""
    c = Chain()
    c.refit(delta=False)
    c.step(0.01)
    last = c.dests[-1].member_id
    c.received[last]["w13_weight"].view(-1)[12345] += 1.0
    mismatched = c.mismatched(c.refit(delta=True))
    assert [m for m, keys in mismatched.items() if keys] == [last], mismatched
    assert len(mismatched[last]) == 1
