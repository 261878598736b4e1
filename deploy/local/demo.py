"""`make demo`: train a tiny Qwen3-MoE with expert TP and refit a live vLLM generator every step.

    python -m deploy.local.demo [--steps 3] [--layout ep2tp2|pp2] [--dtype bfloat16|float32]
                                [--train-dtype bfloat16|float32] [--model-dir DIR]
                                [--refit-mode staged|inplace] [--delta [--full-every K]]
                                [--replicas N] [--lab [--link-gbit G]] [--summary-json PATH]
                                [--pause-mode wait|keep|abort] [--load N [--max-tokens T]]
                                [--lora-rank R [--lora-alpha A]]

Starts syncd, the vLLM generator (CPU) and a 4-rank gloo trainer (`--layout ep2tp2`: ep 2 x tp 2,
experts split over TP; `--layout pp2`: pp 2 x ep 2), all on this machine. The trainer waits after
each step (`--sync-refit`) while this driver measures how far the generator's policy is from the
trainer's (KL of sampled tokens), triggers the refit through syncd's HTTP API, and measures again.
By default the trainer trains in bfloat16 (`--train-dtype`; float32 master weights and optimizer
state) and the generator serves bfloat16 (`--dtype`): the refit carries the bfloat16 weights the
trainer computes with. The trainer exports each step in the served dtype; a float32 trainer's
refit into a bfloat16 generator rounds on the way (half the bytes of float32 to float32).
`--model-dir` starts both from any Qwen3-MoE HF directory instead of the tiny random model; the
prompts are token ids drawn from the model's vocabulary (`--seed`). Per refit the summary gives
the seconds of `transfer` and `verify` (syncd's phases),
`install` (how long the generator held generation to install) and `total`, and the bytes moved.
`--delta` turns syncd's delta refits on: after the first refit each moves only the elements that
changed (`--lr 1e-6` is an RL-like step), and the summary also gives each refit's mode and changed
fraction; `--full-every K` makes every K-th refit a full one, to compare both in one run.
`--replicas N` serves from N vLLM replicas (TP 1, each bound to its own core when there are
several), all refitted together; the KL is measured on replica 0 and every replica must serve
each step's version. `--lab` runs each service on its own host of a lab (`deploy/lab`: network
namespaces on a bridge, links shaped at `--link-gbit`, root needed): syncd, the trainer's ranks,
and each replica; the summary then also gives the bytes that left the trainer's host per refit.
`--pause-mode` is how the generator's refits meet running requests (`wait`, `keep`, `abort`:
generator_svc/README.md, "Pause modes"); `--load N` keeps N clients sending greedy completions of
`--max-tokens` tokens to replica 0 from the trainer's first step on, through every refit, and the
summary then gives per refit `pause_s` (how long the generator held requests), `install_s` (of
which the engine was paused for the install) and `spanning_requests` (requests with tokens from
before and after it), and overall `load_requests`, `failed_requests` and
`responses_without_versions` (answers whose tokens do not say which weight version produced them).
`--lora-rank R` trains LoRA adapters (attention and experts) over the frozen base instead of the
whole model: each refit moves only the target modules' weights, merged in float32 and rounded once
to the served dtype (`trainer_svc.lora.merge`), and the summary's `lora` gives their bytes against
the whole model's and the greedy outputs after each refit (`steps[].greedy`), which equal a fresh
vLLM's on the base merged with that step's adapter (`tests/e2e/test_demo.py`).
Every process it starts, it stops (and the lab, its namespaces). syncd requires a token this
driver makes for the run, in a temporary file (mode 0600) every process is handed by its path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from deploy.lab import Lab, LabError
from deploy.lab import placement as hosts
from deploy.lab.placement import Placement
from deploy.local import openai_client
from deploy.local.load import Load, LoadResult
from deploy.local.processes import PYTHON, Cluster, Proc
from syncd.net import free_port
from syncd.refit_wait import wait_final
from syncd.weight_version import WeightVersion, version_label

LAYOUTS = {"ep2tp2": {"pp": 1, "ep": 2, "tp": 2}, "pp2": {"pp": 2, "ep": 2, "tp": 1}}
PROMPT_LENGTHS = (5, 6, 4, 7)
log = logging.getLogger("demo")


@dataclass(frozen=True)
class StepRow:
    step: int
    loss: float
    refit_state: str
    refit_seconds: float  # total, trigger to outcome
    transfer_seconds: float
    verify_seconds: float
    install_seconds: float  # the generator's hold
    bytes: int
    checksums_ok: bool
    kl_before: float
    kl_after: float
    mode: str = "full"  # or "delta": the generator received only what changed
    changed_fraction: float | None = None
    replicas_on_version: int = 1  # replicas serving this step's version after its refit
    trainer_egress_bytes: int | None = None  # --lab: what left the trainer's host during the refit
    greedy: list[tuple[list[int], list[float]]] | None = None  # --lora-rank: replica 0 after the refit

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.refit_seconds if self.refit_seconds else 0.0


class Generator:
    """The generator's OpenAI-compatible API, through the openai client: sampled tokens and their
    logprobs."""

    def __init__(self, url: str, prompts: list[list[int]]) -> None:
        self.url = url
        self.prompts = prompts
        self.api = openai_client.client(url)
        self.http = httpx.Client(base_url=url, timeout=30)  # the generator's own routes (/v1/install)

    def sample(self, seed: int, max_tokens: int = 24) -> list[tuple[list[int], list[int], list[float]]]:
        out = []
        for i, prompt in enumerate(self.prompts):
            tokens, logprobs = openai_client.complete(
                self.api, "tiny", prompt, max_tokens=max_tokens, temperature=1.0, seed=seed * 100 + i
            )
            out.append((prompt, tokens, logprobs))
        return out

    def greedy(self, max_tokens: int = 8) -> list[tuple[list[int], list[float]]]:
        """Greedy completions of every prompt: their tokens and logprobs."""
        return [
            openai_client.complete(self.api, "tiny", prompt, max_tokens=max_tokens, temperature=0)
            for prompt in self.prompts
        ]

    def serves(self, version: WeightVersion) -> bool:
        return self.http.get("/v1/weight_version").json()["version"] == version_label(version)

    def install_seconds(self, version: WeightVersion) -> float:
        """How long the generator held generation to install `version` (nan if it did not)."""
        last = self.http.get("/v1/install").json()["last"]
        return last["hold_seconds"] if last and last["version"] == version_label(version) else float("nan")


def policy_kl(generator: Generator, export_dir: Path, seed: int) -> float:
    """KL(generator || trainer) over tokens the generator samples, scored by the trainer's model
    on its exported weights."""
    from trainer_svc.scoring import Scorer, kl_estimate

    scorer = Scorer(export_dir)
    behaviour, target = [], []
    for prompt, tokens, logprobs in generator.sample(seed):
        behaviour += logprobs
        target += scorer.logprobs(prompt, tokens)
    return kl_estimate(behaviour, target)


class Syncd:
    def __init__(self, url: str, token: str) -> None:
        headers = {"Authorization": f"Bearer {token}"}
        self.http = httpx.Client(base_url=url, timeout=30, headers=headers)

    def wait_announced(self, version: WeightVersion, timeout_s: float, trainer) -> None:
        deadline = time.monotonic() + timeout_s
        while (self.http.get("/v1/status").json()["announced_version"] or 0) < version:
            if not trainer.alive():
                raise RuntimeError(f"the trainer exited:\n{trainer.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the trainer did not announce version {version} in {timeout_s:.0f} s")
            time.sleep(0.2)

    def refit(self, version: WeightVersion, timeout_s: float, full: bool = False) -> dict:
        r = self.http.post("/v1/refits", json={"weight_version": version, "full": full})
        if r.status_code != 202:
            raise RuntimeError(f"syncd refused the refit: {r.status_code} {r.text}")
        return dict(
            wait_final(lambda path: self.http.get(path).json(), r.json()["id"], timeout_s, poll_s=0.1)
        )


def vocabulary_prompts(model_dir: Path, seed: int) -> list[list[int]]:
    """The demo's prompts: token ids drawn from the model's vocabulary (its config.json), so any
    Qwen3-MoE directory works, whatever its vocabulary size."""
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def trainer_loss(log_text: str, step: int) -> float:
    m = re.search(rf"step {step} loss ([0-9.eE+-]+)", log_text)
    return float(m.group(1)) if m else float("nan")


def start_services(
    cluster: Cluster, work: Path, layout: dict, args, where: Placement, token: str
) -> tuple[Syncd, list[Generator], Proc]:
    from trainer_svc.tiny import make_tiny_checkpoint

    model = (
        Path(args.model_dir).resolve()
        if args.model_dir
        else make_tiny_checkpoint(work / "model", seed=args.seed)
    )
    http_port, grpc_port = free_port(), free_port()
    syncd_address = where.address(hosts.SYNCD)
    syncd = cluster.start(
        "syncd",
        where.command(
            hosts.SYNCD,
            [
                PYTHON,
                "-m",
                "syncd",
                "--host",
                syncd_address,
                "--http-port",
                str(http_port),
                "--grpc-port",
                str(grpc_port),
                "--db",
                str(work / "syncd.db"),
                "--expected-trainers",
                "4",
                "--expected-generators",
                str(args.replicas),
                "--backend",
                "gloo",
                "--bucket-bytes",
                str(1 << 20),
                *(["--delta-refits"] if args.delta else []),
            ],
        ),
    )
    cluster.wait_http(syncd, f"http://{syncd_address}:{http_port}/healthz", 60)
    log.info(
        "syncd up at %s (http %d, grpc %d); starting %d vLLM generator(s) (about 30 s)",
        syncd_address,
        http_port,
        grpc_port,
        args.replicas,
    )
    generators = [
        start_generator(cluster, where, replica, model, f"{syncd_address}:{grpc_port}", args)
        for replica in range(args.replicas)
    ]
    for proc, url in generators:
        cluster.wait_http(proc, f"{url}/healthz", 300)
    log.info(
        "generator(s) up; starting the trainer (4 gloo ranks: pp %(pp)d x ep %(ep)d x tp %(tp)d)", layout
    )
    trainer = cluster.start(
        "trainer",
        where.command(
            hosts.TRAINER,
            [
                PYTHON,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "4",
                "-m",
                "trainer_svc",
                "--pp",
                str(layout["pp"]),
                "--ep",
                str(layout["ep"]),
                "--tp",
                str(layout["tp"]),
                "--model-dir",
                str(model),
                "--steps",
                str(args.steps),
                "--seed",
                str(args.seed),
                "--lr",
                str(args.lr),
                "--device",
                "cpu",
                "--syncd",
                f"{syncd_address}:{grpc_port}",
                "--data-host",
                where.address(hosts.TRAINER),
                "--sync-refit",
                "--export-dir",
                str(work / "export"),
                "--export-each-step",
                "--dtype",
                args.train_dtype,
                "--export-dtype",
                args.dtype,
                *(
                    ["--lora-rank", str(args.lora_rank), "--lora-alpha", str(args.lora_alpha)]
                    if args.lora_rank
                    else []
                ),
            ],
        ),
        env={"OMP_NUM_THREADS": "1"},
    )
    prompts = vocabulary_prompts(model, args.seed)
    apis = [Generator(url, prompts) for _, url in generators]
    return Syncd(f"http://{syncd_address}:{http_port}", token), apis, trainer


def start_generator(
    cluster: Cluster, where: Placement, replica: int, model: Path, syncd: str, args
) -> tuple[Proc, str]:
    """Replica `replica` of the generator (TP 1); its process and URL. Several replicas on one
    machine each bind their OpenMP threads to one core of their own (`VLLM_CPU_OMP_THREADS_BIND`), so
    that they do not compete for the same cores."""
    host, port = hosts.generator_host(replica), free_port()
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    if args.replicas > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(replica % (os.cpu_count() or 1))
    proc = cluster.start(
        "generator" if args.replicas == 1 else f"generator-{replica}",
        where.command(
            host,
            [
                PYTHON,
                "-m",
                "generator_svc",
                "--model",
                str(model),
                "--syncd",
                syncd,
                "--replica",
                str(replica),
                "--data-host",
                where.address(host),
                "--port",
                str(port),
                "--served-model-name",
                "tiny",
                "--dtype",
                args.dtype,
                "--enforce-eager",
                "--refit-mode",
                args.refit_mode,
                "--pause-mode",
                args.pause_mode,
                "--max-model-len",
                str(max(256, max(PROMPT_LENGTHS) + args.max_tokens) if args.load else 256),
                "--skip-tokenizer-init",
            ],
        ),
        env=env,
    )
    return proc, f"http://{where.address(host)}:{port}"


def run(args) -> dict:
    work = Path(args.workdir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    layout = LAYOUTS[args.layout]
    start = time.monotonic()
    rows: list[StepRow] = []
    with contextlib.ExitStack() as stack:  # on the way out: the processes first, then the lab
        lab = None
        if args.lab:
            hosts_of = hosts.hosts(args.replicas)
            lab = stack.enter_context(
                Lab(hosts_of, rate_gbit=args.link_gbit, name="demo", logs=work / "logs")
            )
            log.info("lab up: %s", ", ".join(f"{h} {lab.address(h)}" for h in hosts_of))
        cluster = stack.enter_context(Cluster(work / "logs"))
        # syncd's token for this run (a lab's syncd serves its network), in a file removed on exit.
        token = cluster.make_token(Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="demo-"))))
        syncd, generators, trainer = start_services(cluster, work, layout, args, Placement(lab), token)
        print(
            f"{'step':>4} {'loss':>9} {'refit':>9} {'mode':>5} {'changed':>8} {'seconds':>8} {'install':>8} "
            f"{'MB':>7} {'MB/s':>8} {'checksums':>9} {'KL before':>10} {'KL after':>10}"
            + (f" {'replicas':>8}" if args.replicas > 1 else "")
            + (f" {'egress MB':>9}" if lab else ""),
            flush=True,
        )
        if args.load:
            # The clients start once the trainer has announced its first step. `import torch` binds
            # the importing thread to each core in turn (cpuinfo), and vLLM's CPU worker, bound to
            # a core and busy with the clients, held the trainer's ranks there for minutes.
            syncd.wait_announced(WeightVersion(1), 300, trainer)
        load = Load(generators[0].url, generators[0].prompts, args.load, args.max_tokens).start()
        for step in range(1, args.steps + 1):
            row = refit_step(step, syncd, generators, trainer, lab, work, args)
            rows.append(row)
            print_row(row, args.replicas, lab is not None)
        seen = load.stop()
        history = generators[0].http.get("/v1/install").json()["history"]
        trainer.popen.wait(120)
    return summarize(rows, time.monotonic() - start, args, work) | load_summary(rows, history, seen, args)


def refit_step(
    step: int, syncd: Syncd, generators: list[Generator], trainer: Proc, lab: Lab | None, work: Path, args
) -> StepRow:
    """Wait for the trainer's `step`, refit every replica to it, and measure around it."""
    version = WeightVersion(step)  # the trainer announces step N as version N
    syncd.wait_announced(version, 300, trainer)
    export = work / "export" / f"step-{step}"
    kl_before = policy_kl(generators[0], export, seed=step)
    egress_before = lab.tx_bytes(hosts.TRAINER) if lab else 0
    state = syncd.refit(
        version, 300, full=bool(args.full_every) and step % args.full_every == 1 % args.full_every
    )
    egress = lab.tx_bytes(hosts.TRAINER) - egress_before if lab else None
    committed = state["state"] == "COMMITTED"
    kl_after = policy_kl(generators[0], export, seed=step) if committed else float("nan")
    phases = state.get("phases") or {}
    row = StepRow(
        step,
        trainer_loss(trainer.log.read_text(errors="replace"), step),
        state["state"],
        (state["finished_at"] or time.time()) - state["created_at"],
        phases.get("TRANSFERRING", float("nan")),
        phases.get("VERIFYING", float("nan")),
        generators[0].install_seconds(version) if committed else float("nan"),
        state.get("bytes") or 0,
        committed,
        kl_before,
        kl_after,
        state.get("mode", "full"),
        state.get("changed_fraction"),
        sum(g.serves(version) for g in generators),
        egress,
        generators[0].greedy() if committed and args.lora_rank else None,
    )
    if not committed:
        print(f"     refit failed: {state.get('error')}", flush=True)
    return row


def print_row(row: StepRow, replicas: int, lab: bool) -> None:
    changed = "-" if row.changed_fraction is None else f"{100 * row.changed_fraction:.2f}%"
    checksums = "ok" if row.checksums_ok else "FAILED"
    print(
        f"{row.step:>4} {row.loss:>9.4f} {row.refit_state:>9} {row.mode:>5} {changed:>8} "
        f"{row.refit_seconds:>8.2f} {row.install_seconds:>8.3f} {row.bytes / 1e6:>7.2f} "
        f"{row.mb_per_s:>8.2f} {checksums:>9} "
        f"{row.kl_before:>10.2e} {row.kl_after:>10.2e}"
        + (f" {row.replicas_on_version:>4}/{replicas:<3}" if replicas > 1 else "")
        + (f" {(row.trainer_egress_bytes or 0) / 1e6:>9.2f}" if lab else ""),
        flush=True,
    )


def lora_summary(rows: list[StepRow], work: Path, args) -> dict:
    """What a LoRA run's refits moved: the target modules' bytes in the served dtype, against the
    whole model's (both from the first step's export, the merged model)."""
    from safetensors import safe_open

    from syncd.layout import hf_names
    from trainer_svc.lora.checkpoint import load_adapter

    export = work / "export" / "step-1"
    targets = set(load_adapter(export).targets())
    with safe_open(str(export / "model.safetensors"), framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    itemsize = 2 if args.dtype == "bfloat16" else 4
    sizes = {n: math.prod(shape) * itemsize for n, shape in hf_names.canonical_shapes_from_hf(shapes).items()}
    target_bytes = sum(sizes[n] for n in targets)
    return {
        "rank": args.lora_rank,
        "alpha": args.lora_alpha,
        "target_tensors": len(targets),
        "target_bytes": target_bytes,
        "model_bytes": sum(sizes.values()),
        "refits_moved_only_targets": all(r.bytes == target_bytes for r in rows) and bool(rows),
    }


def summarize(rows: list[StepRow], seconds: float, args, work: Path) -> dict:
    return {
        "refits": len(rows),
        "refits_committed": sum(r.refit_state == "COMMITTED" for r in rows),
        "checksums_ok": all(r.checksums_ok for r in rows) and bool(rows),
        "kl_before_first": rows[0].kl_before if rows else None,
        "kl_after_max": max((r.kl_after for r in rows), default=None),
        "total_seconds": round(seconds, 1),
        "layout": args.layout,
        "train_dtype": args.train_dtype,
        "served_dtype": args.dtype,
        "replicas": args.replicas,
        "lab": {"link_gbit": args.link_gbit} if args.lab else None,
        "all_replicas_served_each_version": all(r.replicas_on_version == args.replicas for r in rows),
        "lora": lora_summary(rows, work, args) if args.lora_rank else None,
        "refit_phases": [
            {
                "step": r.step,
                "transfer": r.transfer_seconds,
                "verify": r.verify_seconds,
                "install": r.install_seconds,
                "total": r.refit_seconds,
                "bytes": r.bytes,
                "mode": r.mode,
                "changed_fraction": r.changed_fraction,
                "trainer_egress_bytes": r.trainer_egress_bytes,
            }
            for r in rows
        ],
        "steps": [asdict(r) for r in rows],
    }


def load_summary(rows: list[StepRow], history: list[dict], seen: LoadResult, args) -> dict:
    """Per committed refit, the serving pause as replica 0 recorded it (`/v1/install`'s history)
    and the requests that spanned it (as the generator counted them, and as the clients saw them);
    overall, what the `--load` clients saw."""
    installs = {h["version"]: h for h in history}
    refits = []
    for r in rows:
        label = version_label(WeightVersion(r.step))
        if r.refit_state == "COMMITTED" and label in installs:
            h = installs[label]
            refits.append(
                {
                    "step": r.step,
                    "pause_s": h["pause_s"],
                    "install_s": h["install_s"],
                    "pause_call_s": h["pause_call_s"],
                    "spanning_requests": h["spanning_requests"],
                    "spanning_requests_seen": seen.spanning[label],
                }
            )
    return {
        "pause_mode": args.pause_mode,
        "load": args.load,
        "max_tokens": args.max_tokens,
        "refit_pauses": refits,
        "load_requests": seen.requests,
        "failed_requests": seen.failed_requests,
        "responses_without_versions": seen.responses_without_versions,
        "load_errors": seen.errors,
    }


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(143)  # unwinds through Cluster.__exit__, which stops every child


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="ep2tp2")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="what the generator serves (and the trainer exports); from a float32 trainer "
        "the refit rounds to it (to nearest even), moving half the bytes for bfloat16",
    )
    parser.add_argument(
        "--train-dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="the trainer's parameters and compute (bfloat16 keeps float32 masters)",
    )
    parser.add_argument(
        "--refit-mode",
        choices=("staged", "inplace"),
        default="staged",
        help="the generator's refit mode (generator_svc/README.md, 'Refit modes')",
    )
    parser.add_argument(
        "--delta",
        action="store_true",
        help="syncd's delta refits: after the first refit, move only the elements that changed",
    )
    parser.add_argument(
        "--full-every",
        type=int,
        default=0,
        metavar="K",
        help="with --delta: make refits 1, K+1, 2K+1, ... full ones (compare both in one run)",
    )
    parser.add_argument(
        "--pause-mode",
        choices=("wait", "keep", "abort"),
        default="wait",
        help="how the generator's refits meet running requests (generator_svc/README.md, 'Pause modes')",
    )
    parser.add_argument(
        "--load", type=int, default=0, metavar="N", help="clients sending greedy completions to replica 0"
    )
    parser.add_argument("--max-tokens", type=int, default=256, help="with --load: tokens per request")
    parser.add_argument("--replicas", type=int, default=1, help="generator replicas (vLLM, TP 1 each)")
    parser.add_argument(
        "--lab",
        action="store_true",
        help="each service on its own host of a lab (network namespaces, shaped links; needs root)",
    )
    parser.add_argument("--link-gbit", type=float, default=1.0, help="with --lab: every link's rate")
    parser.add_argument("--workdir", default="runs/demo")
    parser.add_argument(
        "--model-dir",
        default="",
        help="a Qwen3-MoE HF directory (config.json + *.safetensors) "
        "to train and serve instead of the tiny random model",
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="train LoRA adapters of this rank (attention and experts) over the frozen base; each "
        "refit moves only the target modules, merged (0: train and refit the whole model)",
    )
    parser.add_argument(
        "--lora-alpha", type=float, default=16.0, help="with --lora-rank: scale = alpha / rank"
    )
    parser.add_argument("--summary-json", help="also write the summary here")
    args = parser.parse_args()
    if args.full_every < 0 or (args.full_every and not args.delta):
        parser.error("--full-every takes a positive K, with --delta")
    if args.replicas < 1:
        parser.error(f"--replicas must be >= 1, got {args.replicas}")
    if args.lora_rank < 0 or (args.lora_rank and args.delta):
        parser.error("--lora-rank takes a positive rank, without --delta (its refits are partial)")
    if args.load < 0 or args.max_tokens < 1:
        parser.error(f"--load must be >= 0 and --max-tokens >= 1, got {args.load} and {args.max_tokens}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s demo %(message)s")
    for noisy in ("httpx", "httpx2", "openai"):  # one line per request otherwise (openai uses httpx2)
        logging.getLogger(noisy).setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        summary = run(args)
    except LabError as e:
        print(f"error: --lab: {e}", file=sys.stderr)
        return 2
    line = {k: v for k, v in summary.items() if k not in ("steps", "refit_phases", "refit_pauses")}
    print(f"summary: {json.dumps(line)}")
    if args.load:
        print(f"refit pauses: {json.dumps(summary['refit_pauses'])}")
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary, indent=2) + "\n")
    ok = (
        summary["refits_committed"] == summary["refits"]
        and summary["checksums_ok"]
        and summary["all_replicas_served_each_version"]
        and summary["responses_without_versions"] == 0
        and (summary["lora"] is None or summary["lora"]["refits_moved_only_targets"])
        and (summary["failed_requests"] == 0 or args.pause_mode == "abort")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
