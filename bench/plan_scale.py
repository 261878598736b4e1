"""Planner scale benchmark: a DeepSeek-V3-sized MoE from a PP16 x EP8 x TP2 trainer onto 8 vLLM
replicas of TP8.

    python bench/plan_scale.py [--bucket-mib 64] [--links]

Prints catalog build time, plan time, peak RSS, units, buckets and bytes per stage and link; the
last line is one JSON object (plan_seconds, peak_rss_mib, units, buckets, ...).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
    split_range,
)
from syncd.plan import DestMember, SourceMember, make_plan


@dataclass(frozen=True)
class DeepSeekV3:
    layers: int = 61
    dense_layers: int = 3
    hidden: int = 7168
    dense_inter: int = 18432
    moe_inter: int = 2048
    experts: int = 256
    vocab: int = 129280
    heads: int = 128
    q_lora: int = 1536
    kv_lora: int = 512
    rope_dim: int = 64
    nope_dim: int = 128
    v_dim: int = 128


def canonical_tensors(m: DeepSeekV3) -> dict[int | str, list[CanonicalTensor]]:
    """Canonical tensors per layer (plus 'embed' and 'head'), bf16 except the router bias."""

    def bf16(name, *shape):
        return CanonicalTensor(name, shape, "bfloat16")

    out: dict[int | str, list[CanonicalTensor]] = {
        "embed": [bf16("model.embed_tokens.weight", m.vocab, m.hidden)],
        "head": [bf16("model.norm.weight", m.hidden), bf16("lm_head.weight", m.vocab, m.hidden)],
    }
    for L in range(m.layers):
        p = f"model.layers.{L}"
        ts = [
            bf16(f"{p}.input_layernorm.weight", m.hidden),
            bf16(f"{p}.post_attention_layernorm.weight", m.hidden),
            bf16(f"{p}.self_attn.q_a_proj.weight", m.q_lora, m.hidden),
            bf16(f"{p}.self_attn.q_a_layernorm.weight", m.q_lora),
            bf16(f"{p}.self_attn.q_b_proj.weight", m.heads * (m.nope_dim + m.rope_dim), m.q_lora),
            bf16(f"{p}.self_attn.kv_a_proj_with_mqa.weight", m.kv_lora + m.rope_dim, m.hidden),
            bf16(f"{p}.self_attn.kv_a_layernorm.weight", m.kv_lora),
            bf16(f"{p}.self_attn.kv_b_proj.weight", m.heads * (m.nope_dim + m.v_dim), m.kv_lora),
            bf16(f"{p}.self_attn.o_proj.weight", m.hidden, m.heads * m.v_dim),
        ]
        if m.dense_layers > L:
            ts += [
                bf16(f"{p}.mlp.gate_proj.weight", m.dense_inter, m.hidden),
                bf16(f"{p}.mlp.up_proj.weight", m.dense_inter, m.hidden),
                bf16(f"{p}.mlp.down_proj.weight", m.hidden, m.dense_inter),
            ]
        else:
            ts += [
                bf16(f"{p}.mlp.gate.weight", m.experts, m.hidden),
                CanonicalTensor(f"{p}.mlp.gate.e_score_correction_bias", (m.experts,), "float32"),
                bf16(f"{p}.mlp.experts.gate_proj.weight", m.experts, m.moe_inter, m.hidden),
                bf16(f"{p}.mlp.experts.up_proj.weight", m.experts, m.moe_inter, m.hidden),
                bf16(f"{p}.mlp.experts.down_proj.weight", m.experts, m.hidden, m.moe_inter),
                bf16(f"{p}.mlp.shared_experts.gate_proj.weight", m.moe_inter, m.hidden),
                bf16(f"{p}.mlp.shared_experts.up_proj.weight", m.moe_inter, m.hidden),
                bf16(f"{p}.mlp.shared_experts.down_proj.weight", m.hidden, m.moe_inter),
            ]
        out[L] = ts
    return out


# Which dim a tensor is split on by tensor parallelism (None: replicated), by name suffix.
COLUMN = (
    "q_b_proj.weight",
    "kv_b_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "embed_tokens.weight",
    "lm_head.weight",
)
ROW = ("o_proj.weight", "down_proj.weight")


def tp_dim(c: CanonicalTensor) -> int | None:
    grouped = ".experts." in c.name
    if c.name.endswith(COLUMN):
        return 1 if grouped else 0
    if c.name.endswith(ROW):
        return 2 if grouped else 1
    return None


def trainer_catalog(tensors: list[CanonicalTensor], ep: int, ep_rank: int, tp: int, tp_rank: int) -> Catalog:
    """Expert TP: experts sharded over ep, every tensor split over tp; the fused gate/up expert
    weight is registered as the view [E_l, 2, I/tp, H] (two pieces)."""
    by_name = {c.name: c for c in tensors}
    locals_ = []
    for c in tensors:
        if c.name.endswith("experts.up_proj.weight"):
            continue
        d = tp_dim(c)
        if c.name.endswith("experts.gate_proj.weight"):
            up = by_name[c.name.replace("gate_proj", "up_proj")]
            fused = Stack(1, (Canon(c.name, c.shape), Canon(up.name, up.shape)))  # [E, 2, I, H]
            expr = Sharded(fused, (Shard(0), Shard(2)), (ep, tp), (ep_rank, tp_rank))
            locals_.append(local_tensor(c.name.replace("gate_proj", "gate_up_proj"), c.dtype, expr))
        elif ".experts." in c.name:
            locals_.append(
                local_tensor(
                    c.name,
                    c.dtype,
                    Sharded(Canon(c.name, c.shape), (Shard(0), Shard(2)), (ep, tp), (ep_rank, tp_rank)),
                )
            )
        else:
            pl = (Replicate(), Shard(d) if d is not None else Replicate())
            locals_.append(
                local_tensor(
                    c.name, c.dtype, Sharded(Canon(c.name, c.shape), pl, (ep, tp), (ep_rank, tp_rank))
                )
            )
    return Catalog(tuple(tensors), tuple(locals_))


def vllm_catalog(tensors: list[CanonicalTensor], tp: int, tp_rank: int) -> Catalog:
    """vLLM at TP: w13 = per expert [gate slice; up slice], w2 row-parallel, the rest split on
    their tp dim or replicated."""
    by_name = {c.name: c for c in tensors}
    locals_ = []
    for c in tensors:
        if c.name.endswith("experts.up_proj.weight") or c.name.endswith("shared_experts.up_proj.weight"):
            continue
        d = tp_dim(c)
        expr = Sharded(
            Canon(c.name, c.shape), (Shard(d) if d is not None else Replicate(),), (tp,), (tp_rank,)
        )
        if (
            c.name.endswith("gate_proj.weight")
            and ".mlp." in c.name
            and "layers" in c.name
            and (".experts." in c.name or "shared_experts" in c.name)
        ):
            up = by_name[c.name.replace("gate_proj", "up_proj")]
            assert d is not None, f"{c.name}: a gate projection is cut over TP"
            up_expr = Sharded(Canon(up.name, up.shape), (Shard(d),), (tp,), (tp_rank,))
            locals_.append(local_tensor(c.name, c.dtype, Concat(d, (expr, up_expr))))
            continue
        locals_.append(local_tensor(c.name, c.dtype, expr))
    return Catalog(tuple(tensors), tuple(locals_))


def build_members(m: DeepSeekV3, pp: int, ep: int, tp: int, replicas: int, gen_tp: int):
    per_layer = canonical_tensors(m)
    sources = []
    for stage in range(pp):
        lo, hi = split_range(m.layers, pp, stage)
        tensors = [c for L in range(lo, hi) for c in per_layer[L]]
        tensors += per_layer["embed"] if stage == 0 else []
        tensors += per_layer["head"] if stage == pp - 1 else []
        for e in range(ep):
            for t in range(tp):
                rank = (stage * ep + e) * tp + t
                sources.append(SourceMember(f"trainer-{rank}", stage, trainer_catalog(tensors, ep, e, tp, t)))
    everything = [c for cs in per_layer.values() for c in cs]
    gen_catalogs = [vllm_catalog(everything, gen_tp, t) for t in range(gen_tp)]  # shared by replicas
    dests = [
        DestMember(f"generator-{r}-{t}", gen_catalogs[t]) for r in range(replicas) for t in range(gen_tp)
    ]
    return sources, dests, everything


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=16)
    parser.add_argument("--ep", type=int, default=8)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--gen-tp", type=int, default=8)
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--links", action="store_true", help="print every (stage, src, dst) link")
    args = parser.parse_args()
    model = DeepSeekV3()

    t0 = time.perf_counter()
    sources, dests, canonical = build_members(model, args.pp, args.ep, args.tp, args.replicas, args.gen_tp)
    t1 = time.perf_counter()
    plan = make_plan(sources, dests, bucket_bytes=args.bucket_mib << 20)
    t2 = time.perf_counter()

    model_bytes = sum(c.nbytes for c in canonical)
    links = plan.links()
    per_expert_names = len(canonical) + 3 * (model.layers - model.dense_layers) * (model.experts - 1)
    print(
        f"model: {len(canonical)} canonical tensors (experts grouped; "
        f"{per_expert_names} in HF per-expert names), "
        f"{model_bytes / 2**30:.1f} GiB"
    )
    print(
        f"trainer: pp {args.pp} x ep {args.ep} x tp {args.tp} = {len(sources)} ranks; "
        f"generator: {args.replicas} replicas x tp {args.gen_tp} = {len(dests)} workers"
    )
    print(
        f"catalogs: {len({s.catalog.content_hash for s in sources}) + args.gen_tp} distinct, "
        f"built in {t1 - t0:.2f} s"
    )
    print(
        f"plan: {t2 - t1:.2f} s, {plan.num_units} units, {len(plan.buckets)} buckets of "
        f"<= {args.bucket_mib} MiB, {plan.total_bytes / 2**30:.1f} GiB moved "
        f"({plan.total_bytes / model_bytes:.2f} x model, one copy per replica)"
    )
    print(f"{'stage':>5} {'links':>6} {'GiB':>8} {'MiB/link min':>13} {'median':>8} {'max':>8}")
    for stage, total in plan.stage_bytes().items():
        sizes = [l.bytes / 2**20 for l in links if l.stage == stage]
        print(
            f"{stage:>5} {len(sizes):>6} {total / 2**30:>8.2f} {min(sizes):>13.1f} "
            f"{statistics.median(sizes):>8.1f} {max(sizes):>8.1f}"
        )
    if args.links:
        for l in links:
            print(
                f"link stage={l.stage} {l.src}->{l.dst} bytes={l.bytes} buckets={l.buckets} units={l.units}"
            )
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        json.dumps(
            {
                "plan_seconds": round(t2 - t1, 3),
                "catalog_seconds": round(t1 - t0, 3),
                "peak_rss_mib": round(peak_mib, 1),
                "units": plan.num_units,
                "buckets": len(plan.buckets),
                "links": len(links),
                "bytes": plan.total_bytes,
                "trainer_ranks": len(sources),
                "generator_workers": len(dests),
            }
        )
    )


if __name__ == "__main__":
    main()
