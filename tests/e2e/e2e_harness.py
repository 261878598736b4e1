"""Real services as real processes for the end-to-end tests: syncd, `python -m generator_svc`
(vLLM on CPU) and `torchrun -m trainer_svc` jobs, wired as in production, driven over HTTP; on
this machine's loopback, or each on its own host of a lab (`Stack(work, Placement(lab))`)."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import httpx

from deploy.lab.placement import SYNCD, TRAINER, Placement, generator_host
from deploy.local import openai_client
from deploy.local.processes import PYTHON, Cluster, Proc
from generator_svc.settings import EngineStart
from syncd.net import free_port
from syncd.refit_wait import wait_final
from syncd.weight_version import WeightVersion, version_label
from tests.engines import ENGINE_FLAGS
from tests.polling import wait_until

PROMPTS = {"short": [1, 2, 3, 4, 5], "long": [(i * 37 + 11) % 512 for i in range(200)]}
GENERATOR_FLAGS = ENGINE_FLAGS  # vLLM's flags for the tiny model, as generator_svc passes them on


@dataclass
class Generator:
    proc: Proc
    http: httpx.Client

    def greedy(self, max_tokens: int = 8) -> dict[str, tuple[list[int], list[float]]]:
        """Greedy completions of every prompt, through the openai client as users call it."""
        api = openai_client.client(str(self.http.base_url))
        return {
            name: openai_client.complete(api, "tiny", prompt, max_tokens=max_tokens, temperature=0)
            for name, prompt in PROMPTS.items()
        }

    def load(self, checkpoint: Path, version: WeightVersion) -> None:
        """Load an HF checkpoint through vLLM's own loaders (no syncd, no data plane)."""
        body = {"path": str(checkpoint), "version": version_label(version)}
        r = self.http.post("/v1/weights/load", json=body)
        assert r.status_code == 200, r.text


def rank_pids(torchrun_pid: int) -> list[int]:
    """The trainer ranks of a torchrun job (its children)."""
    children = Path(f"/proc/{torchrun_pid}/task/{torchrun_pid}/children").read_text().split()
    return [int(p) for p in children]


class Stack:
    """One syncd (restartable on the same ports and database) plus generators and trainer jobs;
    `where` places them (syncd, the trainer, generator replica R on hosts `syncd`, `trainer`,
    `genR` of a lab; all on loopback by default)."""

    def __init__(self, work: Path, where: Placement | None = None) -> None:
        self.work, self.where = work, where or Placement()
        self.cluster = Cluster(work / "logs")
        self.token = self.cluster.make_token(work)  # every process gets it (a lab's syncd needs one)
        self.http_port, self.grpc_port = free_port(), free_port()
        self.syncd: Proc | None = None
        self.trainers: list[Proc] = []  # the jobs `train` started, until `stop_trainers`
        base_url = f"http://{self.where.address(SYNCD)}:{self.http_port}"
        headers = {"Authorization": f"Bearer {self.token}"}
        self.http = httpx.Client(base_url=base_url, timeout=30, headers=headers)

    @property
    def target(self) -> str:
        return f"{self.where.address(SYNCD)}:{self.grpc_port}"

    def start_syncd(
        self,
        trainers: int,
        db: str = "syncd.db",
        bucket_bytes: int = 1 << 20,
        generators: int = 1,
        delta: bool = False,
        delta_inplace: bool = False,
        lease_seconds: float = 4,
        auto_refit: bool = False,
    ) -> None:
        """syncd for `trainers` trainer ranks and `generators` generator workers (a TP-2 generator
        has two); `delta`: with delta refits on; `delta_inplace`: to inplace generators too;
        `auto_refit`: a refit of every version a trainer announces."""
        self.stop_syncd()
        self.syncd = self.cluster.start(
            "syncd",
            self.where.command(
                SYNCD,
                [
                    PYTHON,
                    "-m",
                    "syncd",
                    "--host",
                    self.where.address(SYNCD),
                    "--http-port",
                    str(self.http_port),
                    "--grpc-port",
                    str(self.grpc_port),
                    "--db",
                    str(self.work / db),
                    "--expected-trainers",
                    str(trainers),
                    "--expected-generators",
                    str(generators),
                    "--backend",
                    "gloo",
                    "--bucket-bytes",
                    str(bucket_bytes),
                    "--lease-seconds",
                    str(lease_seconds),
                    "--transfer-timeout",
                    "60",
                    *(["--delta-refits"] if delta else []),
                    *(["--delta-inplace"] if delta_inplace else []),
                    *(["--auto-refit"] if auto_refit else []),
                ],
            ),
        )
        self.cluster.wait_http(self.syncd, f"http://{self.where.address(SYNCD)}:{self.http_port}/healthz", 60)

    def stop_syncd(self) -> None:
        if self.syncd is not None:
            self.cluster.discard(self.syncd)
            self.syncd = None

    def start_generator(
        self,
        model: Path,
        tp: int = 1,
        syncd: bool = True,
        name: str = "generator",
        replica: int = 0,
        dtype: str = "bfloat16",
        refit_mode: str = "staged",
        cpus: str | None = None,
        inplace_delta_base: bool = False,
        engine_start: EngineStart = EngineStart.FORK,
    ) -> Generator:
        """Replica `replica` (on host `gen<replica>` of a lab); `cpus`: its workers' OpenMP
        binding (VLLM_CPU_OMP_THREADS_BIND; a TP-N engine defaults to one core per worker);
        `inplace_delta_base`: an inplace generator that takes delta refits; `engine_start`: how
        its engine's processes start (generator_svc's default, fork, or vLLM's own, spawn)."""
        port, host = free_port(), generator_host(replica)
        env: dict[str, str] = {}
        flags = ["--tensor-parallel-size", str(tp)] if tp > 1 else []
        if cpus is not None or tp > 1:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpus or "|".join(str(i) for i in range(tp))
        proc = self.cluster.start(
            name,
            self.where.command(
                host,
                [
                    PYTHON,
                    "-m",
                    "generator_svc",
                    "--model",
                    str(model),
                    "--port",
                    str(port),
                    "--dtype",
                    dtype,
                    *GENERATOR_FLAGS,
                    *flags,
                    "--replica",
                    str(replica),
                    "--refit-mode",
                    refit_mode,
                    *(["--inplace-delta-base"] if inplace_delta_base else []),
                    "--engine-start",
                    engine_start.value,
                    *(["--syncd", self.target, "--data-host", self.where.address(host)] if syncd else []),
                ],
            ),
            env=env,
        )
        url = f"http://{self.where.address(host)}:{port}"
        self.cluster.wait_http(proc, f"{url}/healthz", 300)
        return Generator(proc, httpx.Client(base_url=url, timeout=120))

    def train(
        self,
        model: Path,
        *,
        pp: int,
        ep: int,
        tp: int,
        steps: int,
        export: Path,
        name: str = "trainer",
        sync_refit: bool = True,
        dtype: str = "bfloat16",
        export_dtype: str | None = None,
        lr: float = 3e-3,
    ) -> Proc:
        """A torchrun trainer job training in `dtype` (bfloat16: float32 masters), exporting every
        step in `export_dtype` (default: `dtype`)."""
        world = pp * ep * tp
        job = self.cluster.start(
            name,
            self.where.command(
                TRAINER,
                [
                    PYTHON,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    "--nproc-per-node",
                    str(world),
                    "-m",
                    "trainer_svc",
                    "--pp",
                    str(pp),
                    "--ep",
                    str(ep),
                    "--tp",
                    str(tp),
                    "--model-dir",
                    str(model),
                    "--steps",
                    str(steps),
                    "--lr",
                    str(lr),
                    "--device",
                    "cpu",
                    "--syncd",
                    self.target,
                    "--data-host",
                    self.where.address(TRAINER),
                    "--export-dir",
                    str(export),
                    "--export-each-step",
                    "--dtype",
                    dtype,
                    "--export-dtype",
                    export_dtype or dtype,
                    *(["--sync-refit"] if sync_refit else []),
                ],
            ),
            env={"OMP_NUM_THREADS": "1"},
        )
        self.trainers.append(job)
        return job

    def stop_trainers(self) -> None:
        """Stop every trainer job `train` started: one left running would register with the next
        test's syncd (same ports) and announce its own versions there."""
        for job in self.trainers:
            self.cluster.discard(job)
        self.trainers.clear()

    def train_and_refit(
        self, model: Path, layout: tuple[int, int, int], export: Path, steps: int = 1
    ) -> list[dict]:
        """A trainer job of `layout` (pp, ep, tp) taking `steps` steps, each refitted once announced;
        the refits' final states."""
        pp, ep, tp = layout
        trainer = self.train(model, pp=pp, ep=ep, tp=tp, steps=steps, export=export)
        states = []
        for step in range(1, steps + 1):
            self.wait_announced(step)
            states.append(self.refit(step))
        assert trainer.popen.wait(180) == 0, trainer.tail()
        return states

    def refit_with_a_rank_killed(
        self, model: Path, export: Path, steps: int = 1, lr: float = 3e-3, committed=None
    ) -> dict:
        """A two-rank (ep 2) trainer job whose steps before the last are refitted (then `committed()`
        is called) and whose first rank is killed once the refit of its last step is transferring
        (start syncd with tiny buckets so that the transfer lasts); returns that refit's final state.
        The job is stopped."""
        trainer = self.train(model, pp=1, ep=2, tp=1, steps=steps, export=export, lr=lr)
        for step in range(1, steps):
            self.wait_announced(step)
            assert self.refit(step)["state"] == "COMMITTED"
        if committed is not None:
            committed()
        self.wait_announced(steps)
        self.wait_ready()
        r = self.http.post("/v1/refits", json={"weight_version": steps})
        assert r.status_code == 202, r.text
        refit_id = r.json()["id"]
        wait_until(
            lambda: self.http.get(f"/v1/refits/{refit_id}").json()["state"] == "TRANSFERRING",
            60,
            "the transfer to start",
        )
        os.kill(rank_pids(trainer.popen.pid)[0], signal.SIGKILL)
        state = self.wait_refit(refit_id)
        trainer.stop()
        return state

    def wait_ready(self, timeout_s: float = 120) -> None:
        wait_until(lambda: self.http.get("/readyz").status_code == 200, timeout_s, "syncd ready")

    def wait_announced(self, version: int, timeout_s: float = 180) -> None:
        wait_until(
            lambda: (self.http.get("/v1/status").json()["announced_version"] or 0) >= version,
            timeout_s,
            f"version {version} announced",
        )

    def wait_idle(self, timeout_s: float = 180) -> None:
        """Until no refit runs (after a fault, syncd's retry over the survivors may be running)."""
        wait_until(lambda: self.http.get("/v1/status").json()["state"] == "IDLE", timeout_s, "syncd idle")

    def refit(self, version: int, timeout_s: float = 120) -> dict:
        self.wait_ready()
        r = self.http.post("/v1/refits", json={"weight_version": version})
        assert r.status_code == 202, r.text
        return self.wait_refit(r.json()["id"], timeout_s)

    def wait_refit(self, refit_id: str, timeout_s: float = 120) -> dict:
        return dict(wait_final(lambda path: self.http.get(path).json(), refit_id, timeout_s))

    def stop(self) -> None:
        self.cluster.stop()
        self.http.close()


# What varies between checkpoints of one architecture, and so does not pick a reference engine.
_NOT_ARCHITECTURE = ("torch_dtype", "dtype", "transformers_version")


class References:
    """Engines that say what vLLM generates on a checkpoint, shared by a test session: one per
    model architecture, started on the first checkpoint asked for and loading each later one
    through vLLM's own loaders (tests/generator holds such a load to a fresh engine token for
    token), instead of a fresh engine (~20 s) per checkpoint. TP 1 and bfloat16, as the tests'
    generators; on this machine's loopback, whatever `Stack` a test uses. `engine_start`: how
    their engines start; the session's fork, as generator_svc does (half the CPU of a spawned
    start, and 20 ms of spinning after each request instead of vLLM's second); the LoRA demo's
    spawn, as vLLM does, so that its comparisons with a generator, whose engine forks, also hold
    the two ways of starting equal in bfloat16 (tests/generator does in float32)."""

    def __init__(self, work: Path, engine_start: EngineStart = EngineStart.FORK) -> None:
        self.stack = Stack(work)
        self.engine_start = engine_start
        self.engines: dict[str, Generator] = {}
        self.loads = 0

    def serving(self, checkpoint: Path) -> Generator:
        """The reference engine of `checkpoint`'s architecture, serving `checkpoint`."""
        config = json.loads((checkpoint / "config.json").read_text())
        key = json.dumps({k: v for k, v in config.items() if k not in _NOT_ARCHITECTURE}, sort_keys=True)
        engine = self.engines.get(key)
        if engine is None:
            name = f"reference-{len(self.engines)}"
            engine = self.engines[key] = self.stack.start_generator(
                checkpoint, syncd=False, name=name, engine_start=self.engine_start
            )
        else:
            self.loads += 1
            engine.load(checkpoint, WeightVersion(900_000 + self.loads))
        return engine

    def greedy(self, checkpoint: Path) -> dict[str, tuple[list[int], list[float]]]:
        return self.serving(checkpoint).greedy()

    def stop(self) -> None:
        self.stack.stop()
