"""Run a vLLM engine with the worker extension and write what the coverage test inspects.

    python tests/generator/engine_probe.py --model DIR --tp N --out DIR

With `--ep`, vLLM's expert parallelism (on CPU it loads, registers and installs, but its forward
crashes the worker, so use it without --refit-to/--fail-to). With `--refit-to B` it also refits the
engine to checkpoint B through the staging receive path and back, and writes the greedy outputs
(`outputs.json`). Writes `catalogs.json` (per tp rank: the registered catalog and vLLM's parameter
names) and `tp{rank}.safetensors` (every parameter as vLLM's own loaders wrote it, checkpoint
format) and `installed-tp{rank}.safetensors` (the same, as the install by parameter wrote it). A
separate process, whose engine processes fork from it as generator_svc's do
(`generator_svc.server.engine_start`: bound to their cores as spawned ones are), and which the test
ends with them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument(
        "--ep", action="store_true", help="vLLM's expert parallelism (experts whole over the TP ranks)"
    )
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--refit-to", default="", help="also refit to this checkpoint and back, recording outputs"
    )
    parser.add_argument(
        "--fail-to",
        default="",
        help="also fail an update to this checkpoint half way, recover, "
        "and refit back to --model, recording outputs",
    )
    args = parser.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from generator_svc.server.engine_start import start_engines_by_fork
    from generator_svc.worker_protocol import WorkerSetup
    from testkit import worker_aids
    from tests.engines import KV_CACHE_BYTES

    start_engines_by_fork()  # spawned, each would import vLLM again: 10 s of CPU here

    llm = LLM(
        model=args.model,
        tensor_parallel_size=args.tp,
        enable_expert_parallel=args.ep,
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=256,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        dtype="float32",
        worker_extension_cls="generator_svc.worker.WeightSyncExtension",
        weight_transfer_config={"backend": "syncd_staging"},
    )
    setup = llm.collective_rpc("ws_setup", args=(WorkerSetup(replica=0).to_wire(),))
    catalogs = llm.collective_rpc("ws_catalog")
    names = llm.collective_rpc("ws_param_names")
    llm.collective_rpc(worker_aids.dump_loaded, args=(args.model, args.out))
    llm.collective_rpc(worker_aids.dump_installed, args=(args.model, args.out))
    installs = llm.collective_rpc("ws_last_install")
    inplace = llm.collective_rpc(worker_aids.dump_inplace, args=(args.model, args.out))
    doc = [
        {"setup": s, "catalog": json.loads(c), "params": n, "install": i, "inplace": p}
        for s, c, n, i, p in zip(setup, catalogs, names, installs, inplace)
    ]
    Path(args.out, "catalogs.json").write_text(json.dumps(doc))
    prompts = json.loads(os.environ.get("PROBE_PROMPTS", "{}"))
    if args.refit_to or args.fail_to:
        params = SamplingParams(max_tokens=8, temperature=0, logprobs=1)

        def outputs() -> dict:
            out = {}
            for name, ids in prompts.items():
                o = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0].outputs[0]
                out[name] = [list(o.token_ids), [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)]]
            return out

        def refit(path: str, refit_id: str) -> None:  # the receive path: staging, then vLLM's lifecycle
            llm.collective_rpc("ws_stage_file", args=(path, refit_id))
            llm.collective_rpc("start_weight_update")
            llm.collective_rpc("update_weights", kwargs={"update_info": {"version": refit_id}})
            llm.collective_rpc("finish_weight_update")
            llm.reset_prefix_cache()

        record = {"A": outputs()}
        if args.refit_to:
            refit(args.refit_to, "to")
            record["B"] = outputs()
        else:
            llm.collective_rpc("ws_stage_file", args=(args.fail_to, "doomed"))
            llm.collective_rpc(_break_feed)
            llm.collective_rpc("start_weight_update")
            try:
                llm.collective_rpc("update_weights", kwargs={"update_info": {"version": "doomed"}})
                record["failed"] = False
            except Exception as e:  # noqa: BLE001 - recorded: the test checks it is the expected failure
                record["failed"] = "feed broke after" in str(e)
            llm.collective_rpc("ws_recover")
            # The engine must survive; it must not generate: weights may be torn, and the service
            # refuses generation (503) until the next complete refit, which follows.
            record["alive_after_recover"] = all(s is not None for s in llm.collective_rpc("ws_status"))
            llm.collective_rpc(_mend_feed)
        refit(args.model, "back")
        record["A_again"] = outputs()
        Path(args.out, "outputs.json").write_text(json.dumps(record))
    # Stop the engine's processes (they unlink their shared-memory rings), then skip the rest of
    # vLLM's slow teardown: the files are written.
    llm.llm_engine.engine_core.shutdown(timeout=30)
    os._exit(0)


def _break_feed(worker) -> None:
    """Make the next install from staging fail half way through the model, as a crash would."""
    from generator_svc.worker import install

    full = install.copy_into
    calls = [0]

    def broken(param, staged):
        calls[0] += 1
        if calls[0] > 20:
            raise RuntimeError("feed broke after 20 parameters")
        full(param, staged)

    install.copy_into = broken
    install._unbroken_copy_into = full


def _mend_feed(worker) -> None:
    from generator_svc.worker import install

    install.copy_into = install._unbroken_copy_into


if __name__ == "__main__":
    main()
