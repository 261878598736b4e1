"""The one settings object of generator_svc, from the command line and environment.

Our flags sit on top of vLLM's own server flags (every `vllm serve` flag works, e.g.
`--tensor-parallel-size`); ours are:

    --syncd ADDR          syncd gRPC address; empty: serve without registering (env GENERATOR_SYNCD)
    --replica N           this generator's replica index, the `replica` mesh coordinate
                          (env GENERATOR_REPLICA)
    --refit-mode MODE     `staged` (default): receive into staging beside the live weights while
                          serving goes on, install only complete verified versions (holds
                          generation for the install); `inplace`: no staging memory, generation
                          is held for the whole transfer and the bytes go into the live layers
                          (see generator_svc/README.md for which to pick)
    --pause-mode MODE     how a refit meets running requests: `wait` (default): they finish on the
                          old weights first, so the refit waits for the longest one; `keep`: they
                          are held in the engine across the install and continue on the new
                          weights (their KV is recomputed on the new weights); `abort`: they end
                          at once with a retryable 503 (generator_svc/README.md, "Pause modes")
    --hold-limit-s S      inplace: a refit that neither commits nor aborts within S seconds of
                          holding generation is released as failed (default 300)
    --inplace-delta-base  inplace: keep a checkpoint-format copy of the layers vLLM post-processes
                          (on CPU every linear and MoE layer), so syncd can send deltas
                          (`--delta-refits --delta-inplace`) and a failed delta is rolled back
    --initial-version V   version label of the checkpoint the engine starts on (default "0"); a label
                          only: the workers tell syncd they serve no trainer version until a Commit
    --auth-token-file F   file holding syncd's bearer token (env SYNCD_AUTH_TOKEN_FILE)
    --auth-token T        syncd's bearer token, shown on the command line (env SYNCD_AUTH_TOKEN);
                          give one of the two (`syncd.auth`)
    --data-host           address peers reach this host's data plane on (env GENERATOR_DATA_HOST)
    --engine-start HOW    how vLLM on CPU starts the engine core and workers: `fork` (default):
                          copies of this process, bound to their cores as vLLM binds spawned
                          ones (the same outputs, bit for bit), in about a second instead of
                          15-20 s of importing vLLM again each; `spawn`: vLLM's own way
                          (generator_svc/server/engine_start.py). On GPUs vLLM decides.
    --in-flight-buckets   receive buffers per stage of the data plane (default: 2 staged, 1 inplace,
                          whose extra memory is these buffers plus the layers being received)

Guards of the generation routes (`generator_svc/server/request_limits.py`, `admission.py`,
`engine_health.py`; token ids, prompt lengths and logprobs are bounded by the engine's own
vocabulary, `--max-model-len` and `--max-logprobs`):
    --max-request-bytes N       bodies larger than N bytes are refused with 413 (default 4 MiB)
    --max-n N                   largest `n` / `best_of` of one request (default 16)
    --max-prompts N             most prompts in one completions request (default 64)
    --max-concurrent-requests N generation requests served at once (default 256) ...
    --max-queued-requests N     ... and waiting for a slot (default 1024); beyond both: 429
    --retry-after-s S           the `Retry-After` of a 429 (default 1)
    --engine-death-exit-s S     after the engine dies, answer 503 (health and generation) for S
                                seconds, then exit with status 1 so the supervisor restarts the
                                generator (default 30)
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from enum import StrEnum

from syncd.auth import TokenError, resolve_token

ENV_SYNCD = "GENERATOR_SYNCD"
ENV_REPLICA = "GENERATOR_REPLICA"
ENV_DATA_HOST = "GENERATOR_DATA_HOST"

# The two engine arguments weight sync needs, by name: the worker extension vLLM mixes into every
# worker (`generator_svc.worker`) and the weight-transfer engine it registers there.
WORKER_EXTENSION = "generator_svc.worker.WeightSyncExtension"
TRANSFER_BACKEND = "syncd_staging"


class RefitMode(StrEnum):
    """How a worker receives a refit (generator_svc/README.md, "Refit modes: which to pick"); each
    has one strategy on each side: `server.refit_strategies` in the API server, `worker.worker_modes`
    in the workers."""

    STAGED = "staged"  # into staging beside the live weights, installed on commit
    INPLACE = "inplace"  # into the live layers, generation held for the transfer


class PauseMode(StrEnum):
    """How a refit meets the requests running when it pauses generation: vLLM's own pause modes
    (`AsyncLLM.pause_generation(mode=...)`), named as vLLM names them."""

    WAIT = "wait"  # running requests finish on the old weights; the refit waits for the longest
    KEEP = "keep"  # running requests are held and continue on the new weights
    ABORT = "abort"  # running requests end at once (a retryable 503 to their callers)


class EngineStart(StrEnum):
    """How the engine's processes start on CPU (generator_svc.server.engine_start)."""

    FORK = "fork"  # copies of the API server, bound to their cores as vLLM binds spawned ones
    SPAWN = "spawn"  # vLLM's own way on CPU: fresh interpreters that import vLLM again


# The fields that hold one of these enums: a plain string naming a member is taken too.
_ENUM_FIELDS = (("refit_mode", RefitMode), ("pause_mode", PauseMode), ("engine_start", EngineStart))

# inplace trades the overlap of a second receive buffer for memory: its extra memory is the receive
# buffers plus the layers being received.
IN_FLIGHT_DEFAULT = {RefitMode.STAGED: 2, RefitMode.INPLACE: 1}


@dataclass(frozen=True)
class Settings:
    syncd: str
    replica: int
    refit_mode: RefitMode
    initial_version: str
    auth_token: str
    data_host: str
    in_flight_buckets: int = 2
    pause_mode: PauseMode = PauseMode.WAIT
    hold_limit_s: float = 300.0
    inplace_delta_base: bool = False
    max_request_bytes: int = 4 << 20
    max_n: int = 16
    max_prompts: int = 64
    max_concurrent_requests: int = 256
    max_queued_requests: int = 1024
    retry_after_s: int = 1
    engine_death_exit_s: float = 30.0
    engine_start: EngineStart = EngineStart.FORK

    def __post_init__(self) -> None:
        for name, kind in _ENUM_FIELDS:
            value = getattr(self, name)
            if value not in tuple(kind):
                raise ValueError(f"{name} must be one of {[m.value for m in kind]}, got {value!r}")
            # A plain string naming a member (tests, callers) becomes the enum member.
            object.__setattr__(self, name, kind(value))
        if self.inplace_delta_base and self.refit_mode is not RefitMode.INPLACE:
            raise ValueError(
                f"inplace_delta_base is for --refit-mode inplace, not {self.refit_mode.value} "
                "(staging is the delta base of a staged generator)"
            )
        if not self.hold_limit_s > 0:
            raise ValueError(f"hold_limit_s must be > 0, got {self.hold_limit_s}")
        if self.in_flight_buckets < 1:
            raise ValueError(f"in_flight_buckets must be >= 1, got {self.in_flight_buckets}")
        if self.replica < 0:
            raise ValueError(f"replica must be >= 0, got {self.replica}")
        for name in ("max_request_bytes", "max_n", "max_prompts", "max_concurrent_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_queued_requests", "retry_after_s", "engine_death_exit_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("generator_svc")
    group.add_argument("--syncd", default=os.environ.get(ENV_SYNCD, ""))
    group.add_argument("--replica", type=int, default=int(os.environ.get(ENV_REPLICA, "0")))
    group.add_argument("--refit-mode", default=RefitMode.STAGED.value, choices=[m.value for m in RefitMode])
    group.add_argument("--pause-mode", default=PauseMode.WAIT.value, choices=[m.value for m in PauseMode])
    group.add_argument(
        "--engine-start", default=EngineStart.FORK.value, choices=[m.value for m in EngineStart]
    )
    group.add_argument("--initial-version", default="0")
    group.add_argument("--auth-token", default=None)
    group.add_argument("--auth-token-file", default=None)
    group.add_argument("--data-host", default=os.environ.get(ENV_DATA_HOST, "127.0.0.1"))
    group.add_argument("--in-flight-buckets", type=int, default=None)
    group.add_argument("--hold-limit-s", type=float, default=300.0)
    group.add_argument("--inplace-delta-base", action="store_true")
    group.add_argument("--max-request-bytes", type=int, default=Settings.max_request_bytes)
    group.add_argument("--max-n", type=int, default=Settings.max_n)
    group.add_argument("--max-prompts", type=int, default=Settings.max_prompts)
    group.add_argument("--max-concurrent-requests", type=int, default=Settings.max_concurrent_requests)
    group.add_argument("--max-queued-requests", type=int, default=Settings.max_queued_requests)
    group.add_argument("--retry-after-s", type=int, default=Settings.retry_after_s)
    group.add_argument("--engine-death-exit-s", type=float, default=Settings.engine_death_exit_s)


def parse(argv: list[str] | None = None) -> tuple[Settings, argparse.Namespace]:
    """Our settings plus vLLM's server namespace, with the worker extension and the staging
    weight-transfer backend forced on (the service depends on both)."""
    from generator_svc.vllm_adapter import (
        FlexibleArgumentParser,
        make_arg_parser,
        validate_parsed_serve_args,
    )

    parser = make_arg_parser(FlexibleArgumentParser(prog="python -m generator_svc"))
    add_arguments(parser)
    args = parser.parse_args(argv)
    if getattr(args, "model_tag", None) is not None:
        args.model = args.model_tag
    if args.worker_extension_cls not in ("", WORKER_EXTENSION):
        raise ValueError(f"--worker-extension-cls is set by generator_svc; got {args.worker_extension_cls!r}")
    args.worker_extension_cls = WORKER_EXTENSION
    args.weight_transfer_config = {"backend": TRANSFER_BACKEND}
    validate_parsed_serve_args(args)
    try:
        auth_token = resolve_token(args.auth_token, args.auth_token_file) or ""
    except TokenError as e:
        parser.error(str(e))
    settings = Settings(
        syncd=args.syncd,
        replica=args.replica,
        refit_mode=RefitMode(args.refit_mode),
        initial_version=args.initial_version,
        auth_token=auth_token,
        data_host=args.data_host,
        in_flight_buckets=(
            IN_FLIGHT_DEFAULT[RefitMode(args.refit_mode)]
            if args.in_flight_buckets is None
            else args.in_flight_buckets
        ),
        pause_mode=PauseMode(args.pause_mode),
        hold_limit_s=args.hold_limit_s,
        inplace_delta_base=args.inplace_delta_base,
        max_request_bytes=args.max_request_bytes,
        max_n=args.max_n,
        max_prompts=args.max_prompts,
        max_concurrent_requests=args.max_concurrent_requests,
        max_queued_requests=args.max_queued_requests,
        retry_after_s=args.retry_after_s,
        engine_death_exit_s=args.engine_death_exit_s,
        engine_start=EngineStart(args.engine_start),
    )
    return settings, args
