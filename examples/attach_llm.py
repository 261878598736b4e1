"""An RL framework's own vLLM engine as a weightsync receiver: `LLM(...)`, then one `attach` call.

    python examples/attach_llm.py [--steps 2] [--workdir runs/attach_llm] [--summary-json F]

The script plays the rollout side of an RL framework. It creates vLLM's `LLM` for a tiny random
Qwen3-MoE with weight sync's engine arguments (`generator_svc.attach.ENGINE_ARGS`), attaches it to
syncd (`generator_svc.attach.attach`: its worker registers as replica 0) and generates with it as
any script would. To have something to sync from, it starts syncd and a one-rank trainer_svc job
that trains `--steps` steps, exporting each step as an HF checkpoint, and asks syncd for a refit
of each step (`POST /v1/refits`, what an RL loop's driver or syncd's `--auto-refit` does). After
each refit it records the LLM's greedy completions, while a thread of its own keeps generating as
a rollout loop would (refits pause the engine between two steps; no caller cooperates). At the end
a fresh `LLM` on each step's export completes the same prompts; the summary (`--summary-json`)
has per step `tokens_equal`, `max_abs_logprob_diff` (0.0: the refit put exactly the trainer's bits
there) and `changed` (the step moved the outputs away from the previous version's), and
`background_of_some_version`: every completion of the thread equals what one served version
generates (never torn weights).

With `--syncd HOST:PORT --model DIR --record F` it only attaches to that syncd as `--replica` and
appends one JSON line to F per version it serves (0, then 1..steps) and a last one with the
thread's completions, whoever triggers the refits (`tests/e2e/test_attach_e2e.py`); it starts
nothing else and compares nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: plenty for a tiny model

PROMPTS = [[1, 2, 3, 4, 5], [17, 99, 3, 250, 7, 81], [(i * 37 + 11) % 512 for i in range(100)]]
MAX_TOKENS = 8
# Between the background thread's rounds: leave the CPU to the trainer too. Longer than the second
# vLLM's workers busy-wait after each step (on CPU that wait takes a core), or nothing is left.
ROLLOUT_PAUSE_S = 2.0
log = logging.getLogger("attach_llm")


def make_llm(model: Path, *, weight_sync: bool) -> Any:
    """vLLM's offline engine for the tiny model (no tokenizer: token-id prompts), with weight
    sync's engine arguments when `weight_sync`."""
    from vllm import LLM

    from generator_svc.attach import ENGINE_ARGS

    extra = ENGINE_ARGS if weight_sync else {}
    return LLM(
        model=str(model),
        dtype="bfloat16",
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=256,
        **extra,
    )


def greedy(llm: Any) -> list[dict]:
    """Greedy tokens and their logprobs for every prompt. One prompt at a time, as a server's
    client sends them: a batch of several could round differently in the last bits (the kernels
    pick their blocking by batch size), and the comparisons here are bit for bit."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=1)
    outputs = []
    for prompt in PROMPTS:
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0].outputs[0]
        logprobs = [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]
        outputs.append({"tokens": list(out.token_ids), "logprobs": logprobs})
    return outputs


class Rollouts:
    """The LLM's generation, as a rollout worker runs it: greedy completions of `PROMPTS`, from the
    main thread and, meanwhile, in a loop on a thread of their own (`background`), while refits come
    and go. vLLM's `LLM.generate` is for one caller at a time, hence the lock; the refits need no
    cooperation from the callers."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.background: list[list[dict]] = []  # each loop's outputs, whatever version served them
        self._one_caller = threading.Lock()
        self._stop = threading.Event()
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._loop, name="rollouts", daemon=True)

    def greedy(self) -> list[dict]:
        with self._one_caller:
            return greedy(self.llm)

    def __enter__(self) -> Rollouts:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self._error is not None:
            raise RuntimeError("generating during the refits failed") from self._error

    def _loop(self) -> None:
        try:
            while not self._stop.wait(ROLLOUT_PAUSE_S):
                self.background.append(self.greedy())
        except Exception as e:  # noqa: BLE001 - raised again in the main thread, by __exit__
            self._error = e


def take_refits(
    llm: Any, syncd: str, replica: int, steps: int, refit=None, record: Path | None = None
) -> tuple[dict, list[list[dict]]]:
    """Attach `llm`, and for each version 1..steps (after `refit(version)`, when given) wait until
    it is served and record the greedy outputs, while a thread keeps generating. Returns
    ({version: outputs}, version 0 included; the background thread's outputs)."""
    from generator_svc.attach import attach

    handle = attach(llm, syncd=syncd, replica=replica)
    log.info("attached: %s", [w.member_id for w in handle.workers])
    seen = {}
    try:
        with Rollouts(llm) as rollouts:
            for version in range(steps + 1):
                if version:
                    if refit is not None:
                        refit(version)
                    handle.wait_version(version, exact=True)  # records are per version
                seen[version] = rollouts.greedy()
                log.info("version %d: %s", version, [o["tokens"] for o in seen[version]])
                _record(record, {"version": version, "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
                                 "outputs": seen[version]})  # fmt: skip
        _record(record, {"background": rollouts.background})
    finally:
        handle.close()
    return seen, rollouts.background


def _record(record: Path | None, line: dict) -> None:
    if record is not None:
        with record.open("a") as f:
            f.write(json.dumps(line) + "\n")


def of_some_version(background: list[list[dict]], seen: dict) -> bool:
    """Every background completion equals, prompt by prompt, what some served version generates."""
    return all(out in [seen[v][i] for v in seen] for outputs in background for i, out in enumerate(outputs))


def compare(served: list[dict], fresh: list[dict]) -> dict:
    diffs = [abs(a - b) for s, f in zip(served, fresh) for a, b in zip(s["logprobs"], f["logprobs"])]
    return {
        "tokens_equal": [s["tokens"] for s in served] == [f["tokens"] for f in fresh],
        "max_abs_logprob_diff": max(diffs) if diffs else None,
    }


def run_standalone(args: argparse.Namespace) -> dict:
    """syncd and a trainer job as processes, the attached LLM here, fresh LLMs on the exports."""
    import httpx

    from deploy.local.processes import PYTHON, Cluster
    from syncd.net import free_port
    from syncd.refit_wait import wait_final
    from trainer_svc.tiny import make_tiny_checkpoint

    work = Path(args.workdir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    model, export = make_tiny_checkpoint(work / "model", seed=0), work / "export"
    http_port, grpc_port = free_port(), free_port()
    syncd_url, target = f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"
    with Cluster(work / "logs") as cluster, httpx.Client(base_url=syncd_url, timeout=30) as http:
        syncd = cluster.start(
            "syncd",
            [PYTHON, "-m", "syncd", "--host", "127.0.0.1", "--http-port", str(http_port),
             "--grpc-port", str(grpc_port), "--db", str(work / "syncd.db"), "--expected-trainers", "1",
             "--expected-generators", "1", "--backend", "gloo"],
        )  # fmt: skip
        cluster.wait_http(syncd, f"{syncd_url}/healthz", 60)
        trainer = cluster.start(
            "trainer",
            [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
             "-m", "trainer_svc", "--pp", "1", "--ep", "1", "--tp", "1", "--model-dir", str(model),
             "--steps", str(args.steps), "--lr", "3e-3", "--device", "cpu", "--syncd", target,
             "--export-dir", str(export), "--export-each-step", "--dtype", "bfloat16", "--sync-refit"],
            env={"OMP_NUM_THREADS": "1"},
        )  # fmt: skip

        def refit(version: int) -> None:
            """What the RL loop's driver does once the trainer announced `version`."""
            deadline = time.monotonic() + 300
            while (http.get("/v1/status").json()["announced_version"] or 0) < version or (
                http.get("/readyz").status_code != 200
            ):
                if time.monotonic() > deadline or not trainer.alive():
                    raise RuntimeError(f"step {version} was not announced:\n{trainer.tail(60)}")
                time.sleep(0.2)
            r = http.post("/v1/refits", json={"weight_version": version})
            r.raise_for_status()
            state = wait_final(lambda path: http.get(path).json(), r.json()["id"], 120)
            log.info("refit of step %d: %s", version, state["state"])

        llm = make_llm(model, weight_sync=True)
        seen, background = take_refits(llm, target, 0, args.steps, refit=refit)
        del llm  # its engine core process ends: the fresh engines below get the cores
        if trainer.popen.wait(300) != 0:
            raise RuntimeError(f"the trainer job failed:\n{trainer.tail(60)}")
        refits = http.get("/v1/refits").json()["refits"]
    steps = []
    for version in range(1, args.steps + 1):
        fresh = greedy(make_llm(export / f"step-{version}", weight_sync=False))
        changed = [o["tokens"] for o in seen[version]] != [o["tokens"] for o in seen[version - 1]]
        steps.append({"version": version, **compare(seen[version], fresh), "changed": changed})
    return {
        "refits": len(refits),
        "refits_committed": sum(r["state"] == "COMMITTED" for r in refits),
        "steps": steps,
        "background_completions": len(background),
        "background_of_some_version": of_some_version(background, seen),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--workdir", default="runs/attach_llm")
    parser.add_argument("--summary-json", help="also write the summary here")
    parser.add_argument("--syncd", help="attach to this syncd (gRPC host:port) and start nothing")
    parser.add_argument("--model", help="with --syncd: the checkpoint the LLM starts on")
    parser.add_argument("--replica", type=int, default=0)
    parser.add_argument("--record", help="with --syncd: append a JSON line per served version here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.syncd:
        if not (args.model and args.record):
            parser.error("--syncd needs --model and --record")
        llm = make_llm(Path(args.model), weight_sync=True)
        take_refits(llm, args.syncd, args.replica, args.steps, record=Path(args.record))
        return 0
    summary = run_standalone(args)
    print(f"summary: {json.dumps(summary)}")
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary, indent=2) + "\n")
    ok = (
        summary["refits_committed"] == args.steps
        and summary["background_of_some_version"]
        and all(s["tokens_equal"] and s["max_abs_logprob_diff"] == 0.0 for s in summary["steps"])
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
