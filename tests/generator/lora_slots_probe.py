"""Adapter slots in a real engine: two adapters written alternately into their slots, and a
reference engine that loads each step's adapter from its PEFT-format directory.

    python tests/generator/lora_slots_probe.py --model DIR --work DIR --role slots|reference

`slots`: an engine with `enable_lora` takes adapters `a` (steps 1 and 3) and `b` (step 2) through
`generator_svc.worker.lora_slots.install`, in the call (no files); after each step it records both
adapters' greedy outputs and slot digests, and writes that step's adapter as a PEFT directory.
`reference`: a fresh engine loads every step's PEFT directory through vLLM's own loader and records
the same outputs. A separate process because an `LLM` spawns engine processes that need a
`__main__` guard. Writes `{work}/{role}.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

RANK, ALPHA = 8, 16.0
STEPS = (("a", 1), ("b", 2), ("a", 3))  # (adapter, step): alternately
IDS = {"a": 1, "b": 2}
PROMPTS = [[1, 2, 3, 4, 5], [7, 9, 11], [100, 200, 300, 400]]


def _engine(model: str):
    from vllm import LLM

    return LLM(model=model, enable_lora=True, max_loras=2, max_cpu_loras=8, max_lora_rank=RANK,
               dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True, max_model_len=256)  # fmt: skip


def _greedy(llm, request) -> list:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=8, temperature=0, logprobs=0)
    out = []
    for ids in PROMPTS:
        o = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, lora_request=request, use_tqdm=False)
        c = o[0].outputs[0]
        out.append([list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]])
    return out


def slots(llm, work: Path) -> dict:
    from vllm.lora.request import LoRARequest

    from testkit import worker_aids
    from testkit.tiny_dense import TARGETS, random_adapter, write_peft_adapter

    spec = {"rank": RANK, "alpha": ALPHA, "target_modules": list(TARGETS), "max_position_embeddings": 512}
    served: dict[str, int] = {}
    record = []
    for name, step in STEPS:
        adapter = random_adapter(RANK, seed=step)
        write_peft_adapter(work / f"peft-{name}-{step}", adapter, RANK, ALPHA)
        before = {n: llm.collective_rpc(worker_aids.adapter_slot_digest, args=(IDS[n],))[0] for n in served}
        factors = {n: t.tolist() for n, t in adapter.items()}  # collective_rpc carries plain data
        installed = llm.collective_rpc(worker_aids.install_adapter, args=(IDS[name], factors, spec))[0]
        served[name] = step
        after = {n: llm.collective_rpc(worker_aids.adapter_slot_digest, args=(IDS[n],))[0] for n in served}
        outputs = {n: _greedy(llm, LoRARequest(n, IDS[n], f"/nonexistent/{n}")) for n in served}
        record.append({"adapter": name, "step": step, "added": installed["added"], "served": dict(served),
                       "digests_before": before, "digests_after": after, "outputs": outputs})  # fmt: skip
    return {"steps": record, "base": _greedy(llm, None)}


def reference(llm, work: Path) -> dict:
    from vllm.lora.request import LoRARequest

    out = {}
    for i, (name, step) in enumerate(STEPS):
        path = work / f"peft-{name}-{step}"
        out[f"{name}-{step}"] = _greedy(llm, LoRARequest(f"{name}-{step}", 100 + i, str(path)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--role", choices=("slots", "reference"), required=True)
    args = parser.parse_args()
    work = Path(args.work)
    llm = _engine(args.model)
    result = (slots if args.role == "slots" else reference)(llm, work)
    (work / f"{args.role}.json").write_text(json.dumps(result))
    # Stop the engine's processes (they hold this process's output open), then skip the rest of
    # vLLM's slow teardown: the file is written.
    llm.llm_engine.engine_core.shutdown(timeout=30)
    os._exit(0)


if __name__ == "__main__":
    main()
