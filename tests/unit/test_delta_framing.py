"""How a delta link travels (`syncd.member.dataplane.delta`): in groups of buckets, a header and a
piece each, which relays forward as they arrive. A link cut in several groups through a chain of
relays leaves every replica bit-exact; a header or piece that arrives truncated, or whose codes or
positions do not fit their units, fails the receiver at once with an error that names it (no
hang, nothing written past its unit)."""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable

import pytest
import torch

from syncd.commands import DeltaLinks
from syncd.member.dataplane import GcPause, GlooTransport, LoopOptions, TransferError, catalog_views
from syncd.member.dataplane.delta import Diffs, Mirror, recv_with_deltas, send_with_deltas, wire
from syncd.member.dataplane.relay import DeltaForwarder
from syncd.plan import DestMember, SourceMember, make_plan
from syncd.plan.fanout import make_fanout_plan
from syncd.plan.simulate import materialize
from tests.unit.test_dataplane_gloo import _run_threads
from tests.unit.test_delta_dataplane import ALL, trainer_catalog, vllm_catalog
from tests.unit.test_delta_relay import Chain

_GROUPS = itertools.count()
BUCKET = 1 << 10  # the test model's trainer ranks send a few KB each: several buckets a link


def _chain() -> Chain:
    c = Chain()
    c.plan = make_fanout_plan(c.sources, c.dests, bucket_bytes=BUCKET)
    return c


def _forwarded(monkeypatch, method: str, what: Callable[[torch.Tensor], int]) -> list[int]:
    """`what` of each message relays forward through `DeltaForwarder.<method>` from now on."""
    seen: list[int] = []
    forward = getattr(DeltaForwarder, method)

    def recording(self, link, data):
        seen.append(what(data))
        forward(self, link, data)

    monkeypatch.setattr(DeltaForwarder, method, recording)
    return seen


def _exact_delta_refit(fraction: float) -> tuple[Chain, dict, list]:
    """A full refit through the chain, a step moving `fraction` of the elements, then a delta
    refit: every replica bit-exact and verified. Returns the chain, the delta's stats by member and
    the trainers' links."""
    c = _chain()
    c.refit(delta=False)
    c.step(fraction)
    stats = c.refit(delta=True)
    assert not any(c.mismatched(stats).values()), c.mismatched(stats)
    assert not c.differing(), c.differing()
    return c, stats, [c.plan.for_member(s.member_id) for s in c.sources]


def test_groups_cut_a_link_in_order_at_the_group_size(monkeypatch):
    link = _chain().plan.for_member("trainer-0")
    monkeypatch.setattr(wire, "_GROUP_BYTES", 3 * BUCKET)
    groups = wire._groups(link)
    assert [b for g in groups for b in g] == list(link)
    assert len(groups) > 1
    assert all(len(g) == 1 or sum(b.nbytes for b in g) <= 3 * BUCKET for g in groups)
    monkeypatch.setattr(wire, "_GROUP_BYTES", 1)  # below a bucket: one bucket a group
    assert [len(g) for g in wire._groups(link)] == [1] * len(link)


def test_a_delta_in_many_pieces_through_relays_is_bit_exact(monkeypatch):
    """Groups of two buckets: each trainer's link is several headers and pieces, every relay
    forwards each piece as it arrived, and every replica ends bit-exact, verified."""
    monkeypatch.setattr(wire, "_GROUP_BYTES", 2 * BUCKET)
    forwarded = _forwarded(monkeypatch, "message", lambda data: data.numel())
    c, _, links = _exact_delta_refit(0.01)
    groups = sum(len(wire._groups(link)) for link in links)
    relays = len(c.dests) - 1
    assert len(forwarded) == relays * groups  # at 1% every group has a piece, each hop forwards it


def test_a_link_that_goes_dense_whole_sends_one_header_and_stays_exact(monkeypatch):
    """A step that changes everything: each trainer's link sends its first header only (it says
    the rest goes dense), every relay forwards that one, and every replica ends bit-exact."""
    monkeypatch.setattr(wire, "_GROUP_BYTES", 2 * BUCKET)
    headers = _forwarded(monkeypatch, "header", lambda data: int(data[-1]))  # their trailers
    c, stats, links = _exact_delta_refit(1.0)
    assert all(len(wire._groups(link)) > 1 for link in links)
    assert len(headers) == (len(c.dests) - 1) * len(links)  # one a link, at each hop
    assert all(trailer >= wire._REST_DENSE for trailer in headers)
    assert all(stats[d.member_id].changed == stats[d.member_id].elements for d in c.dests)


class _OneLink:
    """Trainer-0 sends one generator its delta (one group: a header and a piece) by hand, the
    messages `send_with_deltas` makes, as a test changes them; the other trainer ranks send
    nothing: the receiver fails on trainer-0's link, the first it takes."""

    def __init__(self) -> None:
        self.sources = [
            SourceMember(f"trainer-{e * 2 + t}", 0, trainer_catalog(e, t)) for e in range(2) for t in range(2)
        ]
        self.dest = DestMember("gen", vllm_catalog(0, 1, "bfloat16"))
        self.plan = make_plan(self.sources, [self.dest], bucket_bytes=BUCKET)
        rng = torch.Generator().manual_seed(0)
        canonical = {c.name: (torch.randn(c.shape, generator=rng) * 0.02).numpy() for c in ALL}
        self.local = {
            k: torch.from_numpy(v.copy()) for k, v in materialize(self.sources[0].catalog, canonical).items()
        }
        self.collector_on_at_send: list[bool] = []  # `gc.isenabled()` as each message was posted
        self.messages = self._messages(LoopOptions(5))

    def _messages(self, options: LoopOptions) -> list[torch.Tensor]:
        """Trainer-0's delta to the generator after 1% of its elements moved: headers and pieces."""
        sent: list[torch.Tensor] = []
        collector_on = self.collector_on_at_send

        class Done:
            def wait(self, timeout_s: float) -> None: ...
            def fence(self, timeout_s: float) -> None: ...

        class Capture:
            rank, world_size = 0, 2

            def isend(self, buf: torch.Tensor, peer: int) -> Done:
                sent.append(buf.clone())
                collector_on.append(gc.isenabled())
                return Done()

        views, mirror = catalog_views(self.sources[0].catalog, self.local), Mirror()
        mine, ranks = self.plan.for_member("trainer-0"), {"gen": 1}
        diffs = Diffs(mirror)
        send_with_deltas(mine, views, Capture(), ranks, DeltaLinks(None, frozenset(), 0.5), diffs, options)
        diffs.commit(views)
        mirror.version = 1
        rng = torch.Generator().manual_seed(1)
        for t in views.values():
            t[torch.rand(t.shape, generator=rng) < 0.01] += 0.05
        sent.clear()
        collector_on.clear()
        send_with_deltas(
            mine, views, Capture(), ranks, DeltaLinks(1, frozenset({"gen"}), 0.5), Diffs(mirror), options
        )
        assert len(sent) >= 2 and sent[0].dtype == torch.int64 and sent[1].dtype == torch.uint8
        return sent

    def receive(self, messages: list[torch.Tensor]) -> BaseException:
        """Send `messages` from trainer-0; returns what the generator's `recv_with_deltas` raised."""
        raised = self.take(messages, LoopOptions(5))
        assert raised is not None, "the receiver took a broken delta without an error"
        return raised

    def take(self, messages: list[torch.Tensor], options: LoopOptions) -> BaseException | None:
        """Send `messages` from trainer-0 to the generator's `recv_with_deltas`; what it raised."""
        members = [s.member_id for s in self.sources] + ["gen"]
        ranks = {m: i for i, m in enumerate(members)}
        address, store = GlooTransport.create_address("127.0.0.1", len(members), 30)
        group, raised = f"delta-framing{next(_GROUPS)}", []
        received = {t.name: torch.zeros(t.shape, dtype=torch.bfloat16) for t in self.dest.catalog.tensors}

        def member(m: str) -> None:
            transport = GlooTransport.connect(
                address, ranks[m], len(members), group, 30, store if ranks[m] == 0 else None
            )
            try:
                if m == "trainer-0":
                    for handle in [transport.isend(buf, ranks["gen"]) for buf in messages]:
                        handle.wait(5)
                elif m == "gen":
                    views = catalog_views(self.dest.catalog, received)
                    links = DeltaLinks(1, frozenset({"gen"}), 0.5)
                    try:
                        recv_with_deltas(self.plan.for_member("gen"), views, transport, ranks, links, options)
                    except Exception as e:  # noqa: BLE001 - the test inspects what the receiver raised
                        raised.append(e)
            finally:
                transport.close()

        errors = _run_threads([lambda m=m: member(m) for m in members])
        assert not errors, errors
        return raised[0] if raised else None


@pytest.fixture(scope="module")
def one_link() -> _OneLink:
    return _OneLink()


def test_the_collector_stays_paused_through_a_delta_transfer_not_only_its_loops(monkeypatch):
    """A collection mid-refit stalls the host for tens of ms (`gc_pause`): a delta transfer holds
    the pause from its first comparison to its last message, its headers and pieces included, on
    both sides, and lets go after."""
    assert gc.isenabled()
    link, options = _OneLink(), LoopOptions(5, gc_pause=GcPause())
    messages = link._messages(options)  # the sender's headers and pieces, each noting the collector
    assert len(link.collector_on_at_send) == len(messages) >= 2
    assert not any(link.collector_on_at_send)
    posted: list[bool] = []  # the collector's state as each receive was posted
    irecv = GlooTransport.irecv

    def noting_the_collector(self, *args, **kwargs):
        posted.append(gc.isenabled())
        return irecv(self, *args, **kwargs)

    monkeypatch.setattr(GlooTransport, "irecv", noting_the_collector)
    # The generator takes trainer-0's header and piece, then fails on the next rank's header (the
    # other ranks send nothing): every receive was posted paused.
    raised = link.take(messages, options)
    assert isinstance(raised, TransferError) and "from rank 1" in str(raised), raised
    assert len(posted) >= 3 and not any(posted)
    assert gc.isenabled()


def test_a_truncated_piece_fails_the_receiver_naming_it(one_link):
    messages = list(one_link.messages)
    messages[1] = messages[1][:-16].clone()  # the first piece loses its last 16 bytes
    e = one_link.receive(messages[:2])
    assert isinstance(e, TransferError) and "delta piece" in str(e) and "truncated" in str(e), e


def test_a_truncated_header_fails_the_receiver_naming_it(one_link):
    messages = list(one_link.messages)
    messages[0] = messages[0][:-1].clone()
    e = one_link.receive(messages[:1])
    assert isinstance(e, TransferError) and "delta header" in str(e), e


def test_a_header_code_beyond_its_unit_fails_before_any_piece_is_sized(one_link):
    messages = list(one_link.messages)
    messages[0] = messages[0].clone()
    messages[0][0] = 1 << 40  # "2**40 elements changed" in a unit of a few thousand
    e = one_link.receive(messages[:1])
    assert isinstance(e, ValueError) and "delta header of bucket" in str(e) and str(1 << 40) in str(e), e


def test_a_position_outside_its_unit_fails_before_it_is_written(one_link):
    messages = list(one_link.messages)
    piece = messages[1].clone()
    piece[:4].view(torch.int32)[0] = -3  # the first unit's first position
    messages[1] = piece
    e = one_link.receive(messages[:2])
    assert isinstance(e, ValueError) and "delta piece of bucket" in str(e) and "-3" in str(e), e


def test_positions_that_do_not_ascend_fail_before_they_are_written(one_link):
    """The receiver cuts a unit's positions by run on their order: out of order, they are refused."""
    messages = list(one_link.messages)
    codes, units = messages[0].tolist(), one_link.plan.for_member("gen")[0].units
    # the first unit with two positions or more, after the first sparse ones (as the -3 test's)
    k = next(i for i, c in enumerate(codes) if c >= 2)
    assert all(c >= 0 for c in codes[:k])
    at = sum(wire._sparse_bytes(c, u.nbytes // u.canon.numel) for c, u in zip(codes[:k], units))
    piece = messages[1].clone()
    positions = piece[at : at + 8].view(torch.int32)
    positions[0], positions[1] = positions[1].item(), positions[0].item()
    messages[1] = piece
    e = one_link.receive(messages[:2])
    assert isinstance(e, ValueError) and "do not ascend" in str(e), e
