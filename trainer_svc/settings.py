"""The one settings object of trainer_svc, parsed from the command line and torchrun's env vars."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from syncd.auth import ENV_TOKEN, ENV_TOKEN_FILE, TokenError, resolve_token
from syncd.plan.fp8_blocks import BLOCK
from trainer_svc.config import FP8_EXPORT, FP8_UNQUANTIZED_DTYPE
from trainer_svc.lora.config import LoraConfig, LoraTarget
from trainer_svc.parallel_dims import ParallelDims

# The environment variables trainer_svc reads: torchrun's (and syncd's token: `syncd.auth`).
ENV_RANK, ENV_WORLD_SIZE, ENV_LOCAL_RANK = "RANK", "WORLD_SIZE", "LOCAL_RANK"
# The training precisions (`trainer_svc.precision`: bfloat16 computes with float32 masters) and
# the exported checkpoint's dtypes (the casts a refit makes, and blockwise FP8).
TRAIN_DTYPES = ("float32", "bfloat16")
EXPORT_DTYPES = ("float32", "bfloat16", "float16", FP8_EXPORT)


@dataclass(frozen=True)
class TrainSettings:
    model_dir: str | None = None
    init_config: str | None = None
    pp: int = 1
    dp: int = 1
    ep: int = 1
    tp: int = 1
    steps: int = 3
    seed: int = 0
    lr: float = 1e-3
    dtype: str = "float32"  # parameters and compute; bfloat16 keeps float32 masters and optimizer state
    weight_decay: float = 0.0
    optimizer: str = "adamw"  # adamw, or muon (hidden matrices; AdamW for the rest)
    muon_momentum: float = 0.95  # Muon's Nesterov momentum
    muon_ns_steps: int = 5  # Newton-Schulz iterations per orthogonalization
    global_batch_size: int = 8
    seq_len: int = 32
    microbatches: int = 2
    export_dir: str | None = None
    export_each_step: bool = False  # also write export_dir/step-N after every step
    export_dtype: str | None = (
        None  # the exported checkpoint's dtype, or FP8_EXPORT; None: the training dtype
    )
    syncd: str | None = None
    auth_token: str | None = None  # bearer token when syncd requires one
    sync_refit: bool = False  # after announcing a step, wait until every generator serves it
    refit_timeout: float = 300.0  # how long sync_refit waits
    in_flight_buckets: int = 2  # staging buffers the data plane sends from
    data_host: str = "127.0.0.1"  # address this rank's data-plane (gloo) groups listen on
    device: str = "auto"  # cpu, cuda, or auto (cuda when available)
    threads: int = 1  # torch intra-op threads per rank (CPU)
    lora_rank: int = 0  # > 0: train LoRA adapters of this rank over a frozen base (`trainer_svc.lora`)
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = tuple(LoraTarget)

    def __post_init__(self) -> None:
        if (self.model_dir is None) == (self.init_config is None):
            raise ValueError("give exactly one of --model-dir (HF checkpoint) or --init-config (random init)")
        for name in (
            "steps",
            "global_batch_size",
            "seq_len",
            "microbatches",
            "threads",
            "in_flight_buckets",
            "muon_ns_steps",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.global_batch_size % (self.dp * self.ep * self.microbatches):
            raise ValueError(
                f"--global-batch-size {self.global_batch_size} must be divisible by dp {self.dp} x "
                f"ep {self.ep} x microbatches {self.microbatches}"
            )
        if self.dtype not in TRAIN_DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(TRAIN_DTYPES)}, got {self.dtype!r}")
        if self.export_dtype is None:
            object.__setattr__(self, "export_dtype", self.dtype)
        if self.export_dtype not in EXPORT_DTYPES:
            raise ValueError(
                f"--export-dtype must be one of {', '.join(EXPORT_DTYPES)}, got {self.export_dtype!r}"
            )
        if self.export_each_step and not self.export_dir:
            raise ValueError("--export-each-step needs --export-dir")
        if self.sync_refit and not self.syncd:
            raise ValueError("--sync-refit needs --syncd")
        if self.optimizer not in ("adamw", "muon"):
            raise ValueError(f"--optimizer must be adamw or muon, got {self.optimizer!r}")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ValueError(f"--muon-momentum must be in [0, 1), got {self.muon_momentum}")
        if self.device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"--device must be cpu, cuda or auto, got {self.device!r}")
        _ = self.dims  # validates the mesh sizes
        if self.lora_rank:
            _ = self.lora  # validates rank, alpha and targets
            if self.optimizer != "adamw" or self.export_dtype == FP8_EXPORT:
                raise ValueError(
                    "--lora-rank trains with --optimizer adamw and merges into float32, bfloat16 or "
                    f"float16; got --optimizer {self.optimizer} --export-dtype {self.export_dtype}"
                )

    @property
    def lora(self) -> LoraConfig | None:
        """The adapters to train, or None to train the whole model."""
        if not self.lora_rank:
            return None
        try:
            targets = tuple(LoraTarget(t) for t in self.lora_targets)
        except ValueError:
            raise ValueError(
                f"--lora-targets must be among {', '.join(LoraTarget)}, got {', '.join(self.lora_targets)}"
            ) from None
        return LoraConfig(self.lora_rank, self.lora_alpha, targets)

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(pp=self.pp, dp=self.dp, ep=self.ep, tp=self.tp)

    @staticmethod
    def from_argv(argv: list[str] | None = None) -> TrainSettings:
        p = argparse.ArgumentParser(prog="python -m trainer_svc", description=__doc__)
        src = p.add_mutually_exclusive_group(required=True)
        src.add_argument("--model-dir", help="HF directory (config.json + *.safetensors) to start from")
        src.add_argument("--init-config", help="HF config.json for a random init (seeded)")
        for dim in ("pp", "dp", "ep", "tp"):
            p.add_argument(f"--{dim}", type=int, default=1, help=f"{dim} mesh size")
        p.add_argument("--steps", type=int, default=3)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--lr", type=float, default=1e-3)
        p.add_argument(
            "--dtype",
            default="float32",
            choices=TRAIN_DTYPES,
            help="parameters and compute; bfloat16 keeps float32 master weights and optimizer "
            "state, and exports and refits the bfloat16 weights it computes with",
        )
        p.add_argument("--weight-decay", type=float, default=0.0)
        p.add_argument(
            "--optimizer",
            default="adamw",
            choices=("adamw", "muon"),
            help="muon: Muon for attention and expert matrices, AdamW for the rest",
        )
        p.add_argument("--muon-momentum", type=float, default=0.95, help="Muon's Nesterov momentum")
        p.add_argument("--muon-ns-steps", type=int, default=5, help="Newton-Schulz iterations of Muon")
        p.add_argument("--global-batch-size", type=int, default=8, help="sequences per step, all ranks")
        p.add_argument("--seq-len", type=int, default=32)
        p.add_argument("--microbatches", type=int, default=2, help="pipeline microbatches per data rank")
        p.add_argument("--export-dir", help="write the HF checkpoint here after the last step")
        p.add_argument(
            "--export-each-step",
            action="store_true",
            help="also export after every step, to EXPORT_DIR/step-N",
        )
        p.add_argument(
            "--export-dtype",
            default=None,
            choices=EXPORT_DTYPES,
            help="dtype of the exported checkpoint (default: --dtype): what a generator serving "
            "that dtype holds (the weights rounded to nearest even, as a refit converts them); "
            f"{FP8_EXPORT}: blockwise FP8 (the DeepSeek-V3 / Qwen3-FP8 format), attention and "
            f"expert projections as e4m3 with a float32 scale per {BLOCK[0]}x{BLOCK[1]} block, "
            f"quantized from their {FP8_UNQUANTIZED_DTYPE} values, every other tensor in "
            f"{FP8_UNQUANTIZED_DTYPE}",
        )
        p.add_argument("--syncd", help="syncd gRPC address host:port (omit to train standalone)")
        p.add_argument(
            "--auth-token-file",
            default=None,
            help=f"file holding syncd's bearer token (default: ${ENV_TOKEN_FILE}); or --auth-token",
        )
        p.add_argument(
            "--auth-token",
            default=None,
            help=f"syncd's bearer token, shown on the command line (default: ${ENV_TOKEN})",
        )
        p.add_argument(
            "--sync-refit",
            action="store_true",
            help="after each step, wait until every generator serves it (or its refit failed: logged)",
        )
        p.add_argument("--refit-timeout", type=float, default=300.0, help="seconds --sync-refit waits")
        p.add_argument(
            "--in-flight-buckets",
            type=int,
            default=2,
            help="staging buffers the data plane packs into (extra memory = this x bucket size)",
        )
        p.add_argument("--data-host", default="127.0.0.1", help="this host's address for data-plane groups")
        p.add_argument("--device", default="auto", choices=("cpu", "cuda", "auto"))
        p.add_argument("--threads", type=int, default=1, help="torch threads per rank on CPU")
        p.add_argument(
            "--lora-rank",
            type=int,
            default=0,
            help="train LoRA adapters of this rank over the frozen base; refits move only the "
            "target modules' merged weights (0: train every weight)",
        )
        p.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA scale = alpha / rank")
        p.add_argument(
            "--lora-targets",
            nargs="+",
            default=list(LoraTarget),
            choices=list(LoraTarget),
            help="attention: q/k/v/o_proj; experts: every expert's gate/up/down_proj",
        )
        ns = vars(p.parse_args(argv))
        ns["lora_targets"] = tuple(ns["lora_targets"])
        try:
            ns["auth_token"] = resolve_token(ns["auth_token"], ns.pop("auth_token_file"))
        except TokenError as e:
            p.error(str(e))
        return TrainSettings(**ns)


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int

    @staticmethod
    def from_env() -> LaunchEnv:
        """torchrun's variables; a plain `python -m trainer_svc` is a world of one."""
        return LaunchEnv(
            rank=int(os.environ.get(ENV_RANK, "0")),
            world_size=int(os.environ.get(ENV_WORLD_SIZE, "1")),
            local_rank=int(os.environ.get(ENV_LOCAL_RANK, "0")),
        )
