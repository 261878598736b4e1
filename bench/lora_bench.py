"""LoRA refit benchmark: a refit of only the target modules' merged weights against a full refit of
the same model, one trainer rank -> one generator worker (synthetic Qwen3-MoE, vLLM's layout).

    python bench/lora_bench.py --gib 0.25 --rank 8 [--backend gloo|nccl] [--reps 5] [--json OUT]

Refit kinds, each measured in the same rounds (`refit_bench.timed_rounds`) on the same tensors:
- `full`: every tensor (what a refit of a fully trained model moves);
- `merged_attention_experts` / `merged_attention`: a partial trainer's plan (`Catalog.partial`)
  of the targets' merged weights only, plus the trainer's merge of those weights
  (`trainer_svc.lora.merge`: float32, rank-one terms in order, rounded once), which such a refit
  adds before it sends; both timed, and their sum is the refit.
- `slots_attention`: an adapter-slot refit's transfer of the attention targets' A and B only,
  float32 on the trainer into a generator's bfloat16 slot tensors (`syncd.layout.adapters`:
  the plan syncd makes for a refit of a named adapter); the install into vLLM's slots at the
  commit (a copy of those bytes) is not timed here.
The adapter's own bytes (A and B of every target, what adapter slots move) are reported too.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from bench.refit_bench import spawn_workers, timed_rounds
from syncd.layout import Catalog
from syncd.layout.adapters import slot_catalog
from syncd.layout.dtypes import torch_dtype
from syncd.member.adapter_sender import adapter_catalog
from syncd.member.dataplane import (
    GlooTransport,
    LoopCache,
    LoopOptions,
    catalog_views,
    recv_buckets,
    send_buckets,
)
from syncd.plan import DestMember, SourceMember, make_plan
from testkit.synthetic_moe import MoeShape, shape_for, trainer_catalog, vllm_catalog
from trainer_svc.lora import merge_lora

TARGETS = {
    "merged_attention_experts": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"),
    "merged_attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
}


def partial_catalog(catalog: Catalog, projections: tuple[str, ...]) -> Catalog:
    """The trainer's catalog cut to the local tensors of `projections`, partial."""
    tensors = tuple(t for t in catalog.tensors if any(f".{p}" in t.name for p in projections))
    used = {p.canonical for t in tensors for p in t.pieces}
    return replace(
        catalog,
        canonical=tuple(c for c in catalog.canonical if c.name in used),
        tensors=tensors,
        partial=True,
    )


def adapter_bytes(shape: MoeShape, rank: int, projections: tuple[str, ...]) -> int:
    """Bytes of A [r, in] and B [out, r] of every target (per expert for the experts), bfloat16."""
    total = 0
    for c in shape.canonical():
        proj = c.name.split(".")[-2]
        if proj in projections or (proj in ("gate_proj", "up_proj") and "gate_up_proj" in projections):
            *experts, out, inp = c.shape
            total += (experts[0] if experts else 1) * rank * (out + inp) * 2
    return total


def slot_catalogs(shape: MoeShape, rank: int, projections: tuple[str, ...]) -> tuple[Catalog, Catalog]:
    """(the adapter trainer's catalog: A [r, in] and B [out, r] of each dense target, float32;
    a generator's slot catalog of them, bfloat16)."""
    factors = {}
    for c in shape.canonical():
        if c.name.split(".")[-2] in projections and len(c.shape) == 2:
            stem = c.name.removesuffix(".weight")
            factors[f"{stem}.lora_A.weight"] = torch.empty(rank, c.shape[1])
            factors[f"{stem}.lora_B.weight"] = torch.empty(c.shape[0], rank)
    sender = adapter_catalog(factors)
    return sender, slot_catalog("bench", sender, "bfloat16")


def _merge_targets(views: dict[str, torch.Tensor], names: list[str], factors: dict, scale: float) -> None:
    for name in names:
        a, b = factors[name]
        w = views[name]
        w.copy_(merge_lora(w, a, b, scale, w.dtype))


def worker(rank: int, args, port: int, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))  # fmt: skip
    shape = shape_for(args.gib)
    src, dst = trainer_catalog(shape, 1, 0, 1, 0), vllm_catalog(shape, 1, 0)
    sources = {"full": src} | {k: partial_catalog(src, p) for k, p in TARGETS.items()}
    pairs = {kind: (c, dst) for kind, c in sources.items()}
    pairs["slots_attention"] = slot_catalogs(shape, args.rank, TARGETS["merged_attention"])
    plans = {
        kind: make_plan(
            [SourceMember("trainer-0", 0, s)], [DestMember("generator-0-0", d)], bucket_bytes=64 << 20
        )
        for kind, (s, d) in pairs.items()
    }
    gen = torch.Generator().manual_seed(0)

    def held(catalog: Catalog) -> dict[str, torch.Tensor]:
        owned = {
            t.name: torch.randn(t.shape, generator=gen).to(torch_dtype(t.dtype)) for t in catalog.tensors
        }
        return catalog_views(catalog, owned)

    views = held(src if rank == 0 else dst)
    slot_views = held(pairs["slots_attention"][0 if rank == 0 else 1])
    factors = {  # A [.., r, in], B [.., out, r] per target tensor, in the catalog's view shape
        t.name: (torch.randn((*t.shape[:-2], args.rank, t.shape[-1]), generator=gen) / 64,
                 torch.randn((*t.shape[:-1], args.rank), generator=gen) / 64)
        for t in sources["merged_attention_experts"].tensors
    }  # fmt: skip
    box = [""]
    store = None
    if rank == 0:
        box[0], store = GlooTransport.create_address("127.0.0.1", 2, 120)
    dist.broadcast_object_list(box, src=0)
    transport = GlooTransport.connect(box[0], rank, 2, "lora-bench", 300, store)
    me = "trainer-0" if rank == 0 else "generator-0-0"
    ranks, cache = {"trainer-0": 0, "generator-0-0": 1}, LoopCache()

    def refit(kind: str) -> None:
        run = send_buckets if rank == 0 else recv_buckets
        tensors = slot_views if kind.startswith("slots") else views
        run(plans[kind].for_member(me), tensors, transport, ranks, LoopOptions(300, 2), cache=cache)

    methods = {f"transfer_{kind}": (lambda k=kind: refit(k)) for kind in plans}
    for kind in TARGETS:
        names = [t.name for t in sources[kind].tensors]
        methods[f"merge_{kind}"] = lambda n=names: (
            _merge_targets(views, n, factors, 2.0) if rank == 0 else None
        )
    seconds = timed_rounds(methods, torch.device("cpu"), args.reps)
    transport.close()
    if rank == 0:
        result = {
            "bytes": {kind: p.total_bytes for kind, p in plans.items()},
            "adapter_bytes": {kind: adapter_bytes(shape, args.rank, p) for kind, p in TARGETS.items()}
            | {"slots_attention": adapter_bytes(shape, args.rank, TARGETS["merged_attention"])},
            "seconds": seconds,
        }
        Path(out_path).write_text(json.dumps(result))
    dist.destroy_process_group()


def summarize(r: dict, args) -> dict:
    med = {name: statistics.median(t) for name, t in r["seconds"].items()}
    kinds = {}
    for kind, nbytes in r["bytes"].items():
        merge = med.get(f"merge_{kind}", 0.0)
        kinds[kind] = {
            "bytes": nbytes,
            "transfer_s": round(med[f"transfer_{kind}"], 4),
            "merge_s": round(merge, 4),
            "refit_s": round(med[f"transfer_{kind}"] + merge, 4),
            "adapter_bytes": r["adapter_bytes"].get(kind),
        }
    full = kinds["full"]["refit_s"]
    for k in kinds.values():
        k["of_full_time"] = round(k["refit_s"] / full, 3)
        k["of_full_bytes"] = round(k["bytes"] / kinds["full"]["bytes"], 3)
    return {"backend": "gloo", "gib": args.gib, "rank": args.rank, "reps": args.reps, "kinds": kinds,
            "seconds": r["seconds"], "date": datetime.date.today().isoformat()}  # fmt: skip


def report(summary: dict) -> str:
    header = f"{'kind':<26} {'MB':>9} {'transfer s':>11} {'merge s':>8} {'refit s':>8} {'of full':>8} "
    lines = [header + f"{'adapter MB':>11}"]
    for kind, k in summary["kinds"].items():
        adapter = "-" if k["adapter_bytes"] is None else f"{k['adapter_bytes'] / 1e6:.2f}"
        lines.append(
            f"{kind:<26} {k['bytes'] / 1e6:>9.1f} {k['transfer_s']:>11.3f} {k['merge_s']:>8.3f} "
            f"{k['refit_s']:>8.3f} {k['of_full_time']:>8.2f} {adapter:>11}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=0.25, help="model size (synthetic Qwen3-MoE, bfloat16)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank of the merged targets")
    parser.add_argument("--reps", type=int, default=5, help="timed rounds (after one warm-up round)")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    summary = summarize(spawn_workers(worker, args, 2), args)
    print(report(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
