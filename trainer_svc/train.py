"""The training loop: build this rank's stage, train `steps` steps (AdamW or Muon), export.

Lifecycle of a rank (`trainer_svc.job.run`): `process_group(...)` joins the world (gloo on CPU, NCCL
on GPU, same code), `Trainer.create` builds the mesh, the stage and the optimizer, `fit` runs the
steps (and lets the syncd agent announce each new version), `export` writes the HF checkpoint from
rank 0.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from syncd.layout.dtypes import torch_dtype
from syncd.member.dataplane import catalog_views
from syncd.weight_version import WeightVersion
from trainer_svc import data
from trainer_svc.canonical import random_canonical
from trainer_svc.catalog import build_catalog
from trainer_svc.config import ModelArgs
from trainer_svc.hf_checkpoint import CONFIG_FILE, save_hf
from trainer_svc.lora.adapters import LoraAdapters
from trainer_svc.optim.optimizer import build_optimizer
from trainer_svc.parallel_dims import Mesh
from trainer_svc.parallel_export import export_parallel
from trainer_svc.parallelize import build_stage, global_grad_norm, grad_sync_plan, sync_grads
from trainer_svc.pipeline import train_microbatches
from trainer_svc.precision import Precision
from trainer_svc.settings import LaunchEnv, TrainSettings
from trainer_svc.shard_cut import load_into
from trainer_svc.shard_gather import gather_canonical
from trainer_svc.sharded_io import read_shards

log = logging.getLogger("trainer_svc")
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class StepStats:
    step: int
    loss: float
    grad_norm: float
    tokens_per_s: float


@dataclass
class TrainResult:
    steps: list[StepStats] = field(default_factory=list)

    @property
    def losses(self) -> list[float]:
        return [s.loss for s in self.steps]


def pick_device(settings: TrainSettings, env: LaunchEnv) -> torch.device:
    if settings.device == "cuda" or (settings.device == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


@contextlib.contextmanager
def process_group(
    settings: TrainSettings, env: LaunchEnv, init_method: str | None = None
) -> Iterator[torch.device]:
    """Join the world (skipped for a world of one without init_method); always leaves it."""
    torch.set_num_threads(settings.threads)
    device = pick_device(settings, env)
    joined = env.world_size > 1 or init_method is not None
    if joined:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=init_method or "env://",
            rank=env.rank,
            world_size=env.world_size,
            timeout=COLLECTIVE_TIMEOUT,
        )
    try:
        yield device
    finally:
        if joined:
            dist.destroy_process_group()


class Trainer:
    """One rank's model stage, optimizer and step. `lock` is held while parameters change
    (the optimizer step) and `version` (optimizer steps taken) with them: a syncd transfer reading
    the shards takes the lock too, so it sees one consistent version."""

    def __init__(
        self, settings: TrainSettings, args: ModelArgs, mesh: Mesh, canonical: dict | None, device
    ) -> None:
        """`canonical`: the whole model's tensors to cut this rank's shards from, or None to read
        only this rank's boxes from `settings.model_dir`."""
        self.settings, self.args, self.mesh, self.device = settings, args, mesh, device
        self.model = build_stage(args, mesh)
        if canonical is None:
            catalog = build_catalog(args, mesh.dims, mesh.coords)
            params = {n: p.detach() for n, p in self.model.named_parameters()}
            assert settings.model_dir is not None  # no canonical weights given: read them
            read_shards(settings.model_dir, catalog, catalog_views(catalog, params))
        else:
            load_into(self.model, canonical, mesh.dims, mesh.coords)
        self.lora: LoraAdapters | None = None  # with --lora-rank: the adapters, the base frozen
        if settings.lora is not None:
            assert settings.export_dtype is not None  # TrainSettings defaults it to --dtype
            self.lora = LoraAdapters.attach(
                self.model,
                settings.lora,
                mesh.dims,
                mesh.coords,
                settings.seed,
                torch_dtype(settings.export_dtype),
            )
        self.model.to(device)
        if self.lora is not None:
            self.lora.refresh()  # the merged weights where the parameters now live
        self.precision = Precision(self.model, settings.dtype)
        self.plan = grad_sync_plan(self.model, mesh)
        self.optimizer = build_optimizer(settings, self.model, mesh, args)
        self.lock = threading.Lock()
        self.version = WeightVersion(0)
        self.after_step: list[Callable[[StepStats], None]] = []
        self._hosts: list[str] | None = None  # every rank's host name, once an export asked

    @staticmethod
    def create(settings: TrainSettings, env: LaunchEnv, device: torch.device) -> Trainer:
        if settings.model_dir is not None:
            args, canonical = ModelArgs.from_file(Path(settings.model_dir) / CONFIG_FILE), None
        else:
            assert settings.init_config is not None  # TrainSettings requires one of the two
            args = ModelArgs.from_file(settings.init_config)
            canonical = random_canonical(args, settings.seed)
        dims = settings.dims
        dims.validate(args, env.world_size)
        torch.manual_seed(settings.seed)
        mesh = dims.build_mesh(env.rank) if env.world_size > 1 else Mesh.single()
        return Trainer(settings, args, mesh, canonical, device)

    @property
    def distributed(self) -> bool:
        return self.mesh.dims.world_size > 1

    def train_step(self, step: int) -> StepStats:
        s = self.settings
        start = time.perf_counter()
        tokens = data.global_batch(s.seed, step, s.global_batch_size, s.seq_len, self.args.vocab_size)
        mbs = data.local_microbatches(
            tokens, self.mesh.data_rank, self.mesh.dims.data_ranks, s.microbatches, self.device
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss = train_microbatches(self.precision, self.mesh, mbs, s.global_batch_size * s.seq_len)
        sync_grads(self.plan)
        norm = global_grad_norm(self.plan, world=self.distributed)
        with self.lock:
            self.optimizer.step()
            self.precision.refresh()
            if self.lora is not None:
                self.lora.refresh()
            self.version = WeightVersion(step)
        global_loss = self._global_loss(loss)
        elapsed = time.perf_counter() - start
        stats = StepStats(step, global_loss, norm, s.global_batch_size * s.seq_len / elapsed)
        if s.export_each_step:
            self.export(f"{s.export_dir}/step-{step}")  # before the hooks announce the version
        for hook in self.after_step:
            hook(stats)
        return stats

    def _global_loss(self, local: torch.Tensor) -> float:
        """Sum the last stage's per-data-rank losses; TP peers hold copies, count tp 0 only."""
        if not self.distributed:
            return float(local)
        counted = local if self.mesh.coords.tp == 0 else torch.zeros_like(local)
        counted = counted.detach().clone().reshape(1)
        dist.all_reduce(counted)
        return float(counted)

    def fit(self) -> TrainResult:
        result = TrainResult()
        for step in range(1, self.settings.steps + 1):
            stats = self.train_step(step)
            result.steps.append(stats)
            if self.mesh.rank == 0:
                log.info(
                    "step %d loss %.6f grad_norm %.6f tokens/s %.1f",
                    stats.step,
                    stats.loss,
                    stats.grad_norm,
                    stats.tokens_per_s,
                )
        return result

    def export(self, out_dir: str) -> None:
        """Collective: write config.json + model.safetensors. When all ranks share one host (so
        one file system), writer ranks write their own tensors into the file in parallel
        (`parallel_export`); otherwise every shard is gathered and rank 0 writes. Returns on every
        rank only once the files exist (anyone told about the step may read them)."""
        dtype = self.settings.export_dtype
        assert dtype is not None  # TrainSettings defaults it to --dtype
        weights = self.precision.weights if self.lora is None else self.lora.served(self.precision.weights)
        if self.distributed and self._one_host():
            export_parallel(weights, self.mesh, self.args, out_dir, dtype)
            if self.mesh.rank == 0:
                log.info("exported HF checkpoint to %s (parallel writers)", out_dir)
        else:
            canonical = gather_canonical(weights, self.mesh, self.args)
            if self.mesh.rank == 0:
                save_hf(out_dir, self.args, canonical, dtype)
                log.info("exported HF checkpoint to %s", out_dir)
            if self.distributed:
                dist.barrier()
        if self.lora is not None:  # the merged model above; the adapter itself next to it
            self.lora.save_shards(out_dir, self.mesh.dims, self.mesh.coords, self.mesh.rank)
            if self.distributed:
                dist.barrier()

    def _one_host(self) -> bool:
        """Collective (first call only): whether every rank runs on this rank's host."""
        if self._hosts is None:
            self._hosts = [""] * self.mesh.dims.world_size  # all_gather_object fills every entry
            dist.all_gather_object(self._hosts, socket.gethostname())
        return len(set(self._hosts)) == 1
