"""The data-plane benches' setting: four trainer ranks (ep 2 x tp 2, bf16) sending to one receiver
in vLLM's layout (TP 1), each a process of its own over one gloo group, as in `make demo`
(`--layers 4 --experts 8` is the demo's model). Used by `bench.delta_bench` and `bench.landed_bench`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from syncd.member.dataplane import GlooTransport, catalog_views
from syncd.plan import DestMember, Plan, SourceMember, make_plan
from testkit.synthetic_moe import MoeShape, trainer_catalog, vllm_catalog

SENDERS = 4
RECEIVER = "generator"


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The flags `moe_plan` reads: the model's size and the bucket size."""
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--bucket-mib", type=float, default=1.0)


def moe_plan(args: argparse.Namespace) -> tuple[list[SourceMember], DestMember, Plan]:
    shape = MoeShape(
        layers=args.layers,
        hidden=128,
        experts=args.experts,
        moe_inter=64,
        heads=4,
        kv_heads=2,
        head_dim=32,
        vocab=512,
    )
    sources = [
        SourceMember(f"trainer-{e * 2 + t}", 0, trainer_catalog(shape, 2, e, 2, t))
        for e in range(2)
        for t in range(2)
    ]
    dest = DestMember(RECEIVER, vllm_catalog(shape, 1, 0))
    return sources, dest, make_plan(sources, [dest], bucket_bytes=int(args.bucket_mib * (1 << 20)))


Member = Callable[[int, argparse.Namespace, str, dict], None]


def run_members(member: Member, args: argparse.Namespace) -> dict:
    """Run `member(rank, args, gloo_address, results)` in one spawned process per rank (the senders,
    then the receiver) and return what they put in `results`, by member id."""
    address, store = GlooTransport.create_address("127.0.0.1", SENDERS + 1, 120)
    os.environ["OMP_NUM_THREADS"] = "1"
    with mp.Manager() as manager:
        results = manager.dict()
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=member, args=(r, args, address, results)) for r in range(SENDERS + 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        out = dict(results)
    del store  # the rendezvous store lives until every member is done
    return out


@dataclass
class Rank:
    """One member of the bench as its process sees it: its id, plan, tensors and transport."""

    rank: int
    me: str
    sending: bool
    ranks: dict[str, int]  # member id -> gloo rank
    plan: Plan
    views: dict[str, torch.Tensor]  # its catalog's tensors, bf16, random
    transport: GlooTransport
    gen: torch.Generator  # what drew the tensors, for the bench's further draws

    def barrier(self) -> None:
        """Every member waits for all the others (through the receiver, the last rank)."""
        flag = torch.zeros(1, dtype=torch.uint8)
        receiver = SENDERS
        if self.rank == receiver:
            for r in range(SENDERS):
                self.transport.irecv(flag, r).wait(120)
            for r in range(SENDERS):
                self.transport.isend(flag, r).wait(120)
        else:
            self.transport.isend(flag, receiver).wait(120)
            self.transport.irecv(flag, receiver).wait(120)


def join_rank(rank: int, args: argparse.Namespace, address: str, group: str) -> Rank:
    """In a member's process: its plan and random bf16 tensors, connected to the group."""
    torch.set_num_threads(1)
    sources, dest, plan = moe_plan(args)
    members = [s.member_id for s in sources] + [RECEIVER]
    sending = rank < SENDERS
    catalog = sources[rank].catalog if sending else dest.catalog
    gen = torch.Generator().manual_seed(rank)
    tensors = {
        t.name: (torch.randn(t.shape, generator=gen) * 0.02).to(torch.bfloat16) for t in catalog.tensors
    }
    transport = GlooTransport.connect(address, rank, len(members), group, 120)
    return Rank(
        rank,
        members[rank],
        sending,
        {m: i for i, m in enumerate(members)},
        plan,
        catalog_views(catalog, tensors),
        transport,
        gen,
    )
