"""The data-plane benches' setting: four trainer ranks (ep 2 x tp 2, bf16) sending to one receiver
in vLLM's layout (TP 1), each a process of its own over one gloo group, as in `make demo`
(`--layers 4 --experts 8` is the demo's model). Used by `bench.delta_bench` and `bench.landed_bench`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch.multiprocessing as mp

from bench.synthetic_moe import MoeShape, trainer_catalog, vllm_catalog
from syncd.member.dataplane import GlooTransport
from syncd.plan import DestMember, Plan, SourceMember, make_plan

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
