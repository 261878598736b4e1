"""Run under torchrun (4 gloo ranks): for each layout of argv[1] (comma-separated: fsdp2, tp,
fsdp2tp), transformers' Qwen3-MoE parallelized as the example does, one training step, then every
rank's catalog (`syncd.member.dtensor.rank_layout`, built-in names) must reassemble the gathered
canonical checkpoint exactly: each canonical tensor's every element covered, every box holding the
gathered values. Rank 0 writes a JSON report per layout, `LAYOUT.json` in the folder argv[3]
(argv[2]: the model directory). One job for every layout: its ranks import torch and
transformers once.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import Qwen3MoeForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from fsdp2_tp_refit import parallelize, sum_head_norm_grads

from syncd.layout import hf_names
from syncd.member.dtensor import rank_layout
from trainer_svc.hf_checkpoint import load_hf


def main() -> None:
    layouts, model_dir, out_dir = sys.argv[1:4]
    dist.init_process_group("gloo")
    for layout_name in layouts.split(","):
        check(layout_name, model_dir, str(Path(out_dir) / f"{layout_name}.json"))
    # Every rank done before any closes its connections (a rank of _refusal_ranks.py once aborted
    # in CI, 'terminate called without an active exception', maybe at teardown; not reproduced).
    dist.barrier()
    dist.destroy_process_group()


def check(layout_name: str, model_dir: str, out: str) -> None:
    model, mesh = parallelize(
        Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32), layout_name
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=tokens, labels=tokens).loss.backward()
    sum_head_norm_grads(model, mesh)
    optimizer.step()
    layout = rank_layout(model.named_parameters())
    local = layout.local_tensors()
    mine = []
    for t in layout.catalog.tensors:
        view = local[t.name].contiguous().view(t.shape)
        mine += [
            (p.canonical, p.canon, view[p.local.slices()].reshape(p.canon.shape).clone()) for p in t.pieces
        ]
    placements = {n: str(getattr(p, "placements", "plain")) for n, p in model.named_parameters()}
    # the reference: the gathered model saved by transformers, read back as canonical tensors
    gathered = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in model.named_parameters()
    }
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        from fsdp2_tp_refit import save_gathered

        save_gathered(model_dir, gathered, Path(out).with_suffix(".ckpt"))
        _, canonical = load_hf(str(Path(out).with_suffix(".ckpt")))
        covered = {n: torch.zeros(t.shape, dtype=torch.bool) for n, t in canonical.items()}
        wrong = []
        for rank, pieces in enumerate(everyone):
            for name, box, values in pieces:
                if not torch.equal(canonical[name][box.slices()], values):
                    wrong.append(f"rank {rank} {name} {box}")
                covered[name][box.slices()] = True
        report = {
            "placements": placements,
            "uncovered": sorted(n for n, c in covered.items() if not bool(c.all())),
            "wrong": wrong,
            "grouped": sorted(n for n in canonical if hf_names.is_grouped_expert(n)),
        }
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
    dist.barrier()  # the next layout's model after this one's report


if __name__ == "__main__":
    main()
