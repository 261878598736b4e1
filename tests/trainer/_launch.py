"""Run a trainer_svc job in spawned processes (one per rank) and collect what every rank saw.

Workers are started from a forkserver that has imported torch and trainer_svc once, so a layout
of 8 ranks does not pay 8 torch imports on a 2-core machine. Every rank writes
`rank{r}.pt` (coords, step stats, its local parameters); rank 0 also exports the HF checkpoint.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import multiprocessing.forkserver
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as tmp

from trainer_svc.job import run
from trainer_svc.settings import LaunchEnv, TrainSettings

# The training settings every trainer test shares (small, fast, and layout-independent).
TRAIN = {
    "steps": 3,
    "seed": 7,
    "lr": 1e-4,
    "weight_decay": 0.01,
    "global_batch_size": 8,
    "seq_len": 16,
    "microbatches": 2,
}

multiprocessing.forkserver.set_forkserver_preload(["torch", "trainer_svc.train", "_launch"])


@dataclass(frozen=True)
class RankOutput:
    coords: dict[str, int]
    losses: list[float]
    grad_norms: list[float]
    params: dict[str, torch.Tensor]
    muon_paths: dict[str, str]  # parameter name -> Muon communication path ({} under AdamW)


def _worker(rank: int, world: int, init_file: str, settings: TrainSettings, out_dir: str) -> None:
    env = LaunchEnv(rank=rank, world_size=world, local_rank=rank)
    trainer, result = run(settings, env, init_method=f"file://{init_file}")
    params = {n: p.detach().cpu().clone() for n, p in trainer.model.named_parameters()}
    paths = getattr(trainer.optimizer, "paths", {})
    out = RankOutput(
        trainer.mesh.coords.as_dict(), result.losses, [s.grad_norm for s in result.steps], params, paths
    )
    torch.save(dataclasses.asdict(out), Path(out_dir) / f"rank{rank}.pt")


def run_job(settings: TrainSettings, out_dir: Path, timeout_s: float = 180.0) -> list[RankOutput]:
    """Train `settings` on `settings.dims.world_size` processes (gloo); return every rank's output."""
    world = settings.dims.world_size
    out_dir.mkdir(parents=True, exist_ok=True)
    init_file = out_dir / "rendezvous"
    if init_file.exists():
        os.remove(init_file)
    ctx = tmp.start_processes(
        _worker,
        args=(world, str(init_file), settings, str(out_dir)),
        nprocs=world,
        join=False,
        start_method="forkserver",
    )
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=5):  # returns False while some rank still runs
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            raise TimeoutError(f"layout {settings.dims} did not finish in {timeout_s}s")
    return [RankOutput(**torch.load(out_dir / f"rank{r}.pt")) for r in range(world)]
