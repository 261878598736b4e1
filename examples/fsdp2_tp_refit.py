"""Any PyTorch trainer as a weightsync sender: FSDP2 + tensor parallel on 4 CPU ranks, one call.

    python examples/fsdp2_tp_refit.py [--layout fsdp2tp|fsdp2|tp] [--steps 3] [--generator-tp 1|2]
                                      [--summary-json F]

The launcher (this script without `--rank-job`) starts syncd (auto-refit) and a vLLM CPU generator
serving a tiny random Qwen3-MoE, then runs itself under torchrun on 4 gloo ranks (`--rank-job`):
each rank loads the same checkpoint into transformers' `Qwen3MoeForCausalLM`, parallelizes it
(`fsdp2`: FSDP2 over 4 ranks; `tp`: tensor parallel over 4 ranks, attention and vocabulary
sharded; `fsdp2tp`: a 2 x 2 mesh, TP inside FSDP2, so column-parallel weights carry
`(_StridedShard(0, sf=2), Shard(0))`), calls `syncd.member.attach.attach` once, and trains: every
optimizer step is a weight version that syncd refits into the generator while the ranks wait.
After the last step the ranks gather the full state dict (`DTensor.full_tensor()`) and rank 0
saves it with transformers. The launcher then asks the generator and a fresh vLLM engine on that
state dict for greedy completions: `--summary-json F` writes `refits`, `refits_committed`,
`tokens_equal` and `max_abs_logprob_diff` (0.0 when the refit put exactly the trained bits there).
Every process it starts, it stops.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROMPTS = [[1, 2, 3, 4, 5], [17, 99, 3, 250, 7, 81], [(i * 37 + 11) % 512 for i in range(100)]]
VLLM_FLAGS = [
    "--served-model-name",
    "tiny",
    "--enforce-eager",
    "--max-model-len",
    "256",
    "--skip-tokenizer-init",
]
log = logging.getLogger("fsdp2_tp_refit")


# ---- the trainer: what a user's own training script looks like (runs on every rank) ----


def parallelize(model, layout: str):
    """FSDP2 and/or tensor parallel, as a torchtitan-style recipe. TP first: FSDP2 then shards the
    TP shards over dp (right-to-left: that is where `_StridedShard` comes from)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    shape, names = {"fsdp2": ((4,), ("dp",)), "tp": ((4,), ("tp",)), "fsdp2tp": ((2, 2), ("dp", "tp"))}[
        layout
    ]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    if "tp" in names:
        tp = mesh["tp"]
        parallelize_module(
            model,
            tp,
            {
                "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
                "lm_head": ColwiseParallel(output_layouts=Replicate()),
            },
        )
        for layer in model.model.layers:
            attention = {f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
            attention["self_attn.o_proj"] = RowwiseParallel(output_layouts=Replicate())
            parallelize_module(layer, tp, attention)
        # the experts, the router and the norms stay whole over tp (plain tensors: replicated)
    if "dp" in names:
        dp = mesh["dp"]
        for layer in model.model.layers:
            fully_shard(layer, mesh=dp)
        fully_shard(model, mesh=dp)
    return model, mesh


def sum_head_norm_grads(model, mesh) -> None:
    """q_norm and k_norm stay whole over tp, but each tp rank normalizes only its own heads, so
    its gradient covers only those: sum them over tp (before the step), or the tp ranks' copies
    drift apart. FSDP2 has already reduced them over dp; this adds the tp sum to that shard."""
    import torch.distributed as dist

    if "tp" not in (mesh.mesh_dim_names or ()):
        return
    group = mesh["tp"].get_group()
    for name, p in model.named_parameters():
        if name.endswith(("q_norm.weight", "k_norm.weight")) and p.grad is not None:
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            dist.all_reduce(grad, group=group)


def rank_job(args) -> None:
    import torch
    import torch.distributed as dist
    from transformers import Qwen3MoeForCausalLM

    from syncd.member.attach import attach

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(name)s %(message)s")
    torch.manual_seed(args.seed)
    model, mesh = parallelize(
        Qwen3MoeForCausalLM.from_pretrained(args.model, dtype=torch.float32), args.layout
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # The one call: catalog from the DTensor placements, HF names built in, refit after each step.
    handle = attach(model, syncd=args.syncd, optimizer=optimizer, wait_s=300)
    if rank == 0:
        for name, p in list(model.named_parameters())[:3]:
            log.info("%s %s %s", name, tuple(p.shape), getattr(p, "placements", "plain"))
    data = torch.Generator().manual_seed(args.seed)
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, model.config.vocab_size, (4, 32), generator=data)  # same on every rank
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        sum_head_norm_grads(model, mesh)
        optimizer.step()  # attach's hook: version `step`, served by the generator when this returns
        optimizer.zero_grad()
        log.info("step %d loss %.4f", step, loss.item())
    gathered = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in model.named_parameters()
    }
    if rank == 0:
        save_gathered(args.model, gathered, Path(args.gathered), args.gathered_dtype)
    handle.close()
    dist.destroy_process_group()


def save_gathered(model_dir: str, state: dict, out: Path, dtype: str = "float32") -> None:
    """The gathered parameters as an HF checkpoint, written by transformers (not by weightsync),
    in `dtype` (torch's `.to()`: round to nearest even, as a float32 sender's refit into a
    bfloat16 generator rounds)."""
    import torch
    from transformers import AutoConfig, Qwen3MoeForCausalLM

    whole = Qwen3MoeForCausalLM(AutoConfig.from_pretrained(model_dir))
    missing, unexpected = whole.load_state_dict(state, strict=False)
    if unexpected or any(not k.endswith("rotary_emb.inv_freq") for k in missing):
        raise RuntimeError(f"gathered state dict: missing {missing}, unexpected {unexpected}")
    whole.to(getattr(torch, dtype)).save_pretrained(out)


# ---- the launcher: syncd, the generator, the trainer job, and the check against a fresh engine ----


def greedy(url: str) -> list[tuple[list[int], list[float]]]:
    from deploy.local import openai_client

    api = openai_client.client(url)
    return [openai_client.complete(api, "tiny", p, max_tokens=8, temperature=0) for p in PROMPTS]


def start_vllm(cluster, name: str, model: Path, tp: int, extra: list[str]) -> str:
    from deploy.local.processes import PYTHON
    from syncd.net import free_port

    port = free_port()
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
    flags = [*VLLM_FLAGS, "--tensor-parallel-size", str(tp), "--port", str(port), "--dtype", "bfloat16"]
    proc = cluster.start(name, [PYTHON, "-m", *extra, "--model", str(model), *flags], env=env)
    cluster.wait_http(
        proc,
        f"http://127.0.0.1:{port}/health" if "vllm" in extra[0] else f"http://127.0.0.1:{port}/healthz",
        900,  # a shared 2-core machine under load has taken over 300 s to start a TP 2 engine
    )
    return f"http://127.0.0.1:{port}"


def launch(args) -> dict:
    import httpx

    from deploy.local.processes import PYTHON, Cluster
    from syncd.net import free_port
    from trainer_svc.config import ModelArgs
    from trainer_svc.tiny import TINY_ARGS, make_tiny_checkpoint

    work = Path(args.workdir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    # 4 kv heads, so attention splits over tp 4 whole heads per rank
    model = make_tiny_checkpoint(
        work / "model", seed=args.seed, args=ModelArgs(**{**TINY_ARGS.__dict__, "num_key_value_heads": 4})
    )
    http_port, grpc_port = free_port(), free_port()
    with Cluster(work / "logs") as cluster:
        syncd = cluster.start(
            "syncd",
            [PYTHON, "-m", "syncd", "--host", "127.0.0.1", "--http-port", str(http_port),
             "--grpc-port", str(grpc_port), "--db", str(work / "syncd.db"), "--expected-trainers", "4",
             "--expected-generators", str(args.generator_tp), "--backend", "gloo", "--auto-refit"],
        )  # fmt: skip
        cluster.wait_http(syncd, f"http://127.0.0.1:{http_port}/healthz", 60)
        generator = start_vllm(
            cluster,
            "generator",
            model,
            args.generator_tp,
            ["generator_svc", "--syncd", f"127.0.0.1:{grpc_port}"],
        )
        log.info("syncd and the generator are up; training %s on 4 gloo ranks", args.layout)
        gathered = work / "gathered"
        trainer = cluster.start(
            "trainer",
            [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", __file__,
             "--rank-job", "--layout", args.layout, "--model", str(model),
             "--syncd", f"127.0.0.1:{grpc_port}",
             "--steps", str(args.steps), "--lr", str(args.lr), "--seed", str(args.seed),
             "--gathered", str(gathered)],
            env={"OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        if trainer.popen.wait(args.timeout_s) != 0:
            raise RuntimeError(f"the trainer job failed:\n{trainer.tail(60)}")
        refits = httpx.get(f"http://127.0.0.1:{http_port}/v1/refits").json()["refits"]
        served = greedy(generator)
        fresh = greedy(
            start_vllm(cluster, "fresh", gathered, args.generator_tp, ["vllm.entrypoints.openai.api_server"])
        )
    diffs = [abs(a - b) for (_, la), (_, lb) in zip(served, fresh) for a, b in zip(la, lb)]
    return {
        "layout": args.layout,
        "generator_tp": args.generator_tp,
        "refits": len(refits),
        "refits_committed": sum(r["state"] == "COMMITTED" for r in refits),
        "tokens_equal": [t for t, _ in served] == [t for t, _ in fresh],
        "max_abs_logprob_diff": max(diffs) if diffs else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=("fsdp2tp", "fsdp2", "tp"), default="fsdp2tp")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--generator-tp", type=int, choices=(1, 2), default=1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default="runs/fsdp2_tp_refit")
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--summary-json", help="also write the summary here")
    parser.add_argument("--rank-job", action="store_true", help=argparse.SUPPRESS)  # under torchrun
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--syncd", help=argparse.SUPPRESS)
    parser.add_argument("--gathered", help=argparse.SUPPRESS)
    parser.add_argument("--gathered-dtype", default="float32", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_job:
        rank_job(args)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    summary = launch(args)
    print(f"summary: {json.dumps(summary)}")
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary, indent=2) + "\n")
    ok = (
        summary["refits_committed"] == summary["refits"] == args.steps
        and summary["max_abs_logprob_diff"] == 0.0
    )
    return 0 if ok and summary["tokens_equal"] else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(REPO))
    raise SystemExit(main())
