"""What a vLLM engine must be built with to take weight sync, and what attaching it is refused for.

`ENGINE_ARGS` (an `LLM`'s keyword arguments) and `SERVE_FLAGS` (`vllm serve`'s flags) name the
worker extension (`generator_svc.worker.WeightSyncExtension`, or a subclass of it), the
weight-transfer engine and, for `vllm serve`, the middleware. `refusals` reads a built engine's
`VllmConfig` and names each engine argument it lacks; `make_settings` turns an attach call's options
into the generator's `Settings` (the same meaning as `python -m generator_svc`'s flags).
"""

from __future__ import annotations

import importlib
import json
from typing import Any

from generator_svc.settings import (
    IN_FLIGHT_DEFAULT,
    TRANSFER_BACKEND,
    WORKER_EXTENSION,
    PauseMode,
    RefitMode,
    Settings,
)
from syncd.auth import resolve_token

ENGINE_ARGS: dict[str, Any] = {
    "worker_extension_cls": WORKER_EXTENSION,
    "weight_transfer_config": {"backend": TRANSFER_BACKEND},
}
MIDDLEWARE = "generator_svc.attach.WeightSyncMiddleware"
SERVE_FLAGS: list[str] = [
    "--worker-extension-cls",
    WORKER_EXTENSION,
    "--weight-transfer-config",
    json.dumps({"backend": TRANSFER_BACKEND}, separators=(",", ":")),  # one shell word
    "--middleware",
    MIDDLEWARE,
]
ATTACH_ROUTE = "/weightsync/attach"


class AttachRefused(ValueError):
    """The engine lacks what weight sync needs; the message names the engine argument."""


def refusals(vllm_config: Any) -> list[str]:
    """What the engine built from `vllm_config` lacks for weight sync, one line per engine
    argument (empty: it can be attached)."""
    from generator_svc.vllm_adapter import weight_transfer_backend_of, worker_extension_of

    problems = []
    extension = worker_extension_of(vllm_config)
    if not _is_weight_sync_extension(extension):
        problems.append(
            f"worker_extension_cls (--worker-extension-cls) is {extension!r}: weight sync needs "
            f"{WORKER_EXTENSION!r} or a subclass of it"
        )
    backend = weight_transfer_backend_of(vllm_config)
    if backend != TRANSFER_BACKEND:
        given = "not set" if backend is None else f"backend {backend!r}"
        problems.append(
            f"weight_transfer_config (--weight-transfer-config) is {given}: weight sync needs "
            f"{{'backend': {TRANSFER_BACKEND!r}}}"
        )
    return problems


def _is_weight_sync_extension(qualname: str) -> bool:
    if qualname == WORKER_EXTENSION:
        return True
    module, _, name = qualname.rpartition(".")
    if not module:
        return False
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return False
    from generator_svc.worker import WeightSyncExtension

    return isinstance(cls, type) and issubclass(cls, WeightSyncExtension)


def refuse_unless_attachable(vllm_config: Any) -> None:
    if problems := refusals(vllm_config):
        raise AttachRefused("cannot attach weight sync to this engine: " + "; ".join(problems))


def make_settings(
    syncd: str,
    replica: int = 0,
    *,
    refit_mode: RefitMode = RefitMode.STAGED,
    pause_mode: PauseMode = PauseMode.WAIT,
    auth_token: str = "",
    auth_token_file: str = "",
    data_host: str = "127.0.0.1",
    in_flight_buckets: int | None = None,
    hold_limit_s: float = 300.0,
    initial_version: str = "0",
) -> Settings:
    """The generator settings of an attached engine (`generator_svc.settings`: the same meaning as
    `python -m generator_svc`'s flags of these names; without `auth_token` or `auth_token_file`,
    the token comes from SYNCD_AUTH_TOKEN_FILE or SYNCD_AUTH_TOKEN, `syncd.auth`); raises
    ValueError naming a bad value."""
    if not syncd:
        raise ValueError("syncd must be syncd's gRPC address (host:port), got ''")
    mode = RefitMode(refit_mode)
    return Settings(
        syncd=syncd,
        replica=replica,
        refit_mode=mode,
        initial_version=initial_version,
        auth_token=resolve_token(auth_token, auth_token_file) or "",
        data_host=data_host,
        in_flight_buckets=IN_FLIGHT_DEFAULT[mode] if in_flight_buckets is None else in_flight_buckets,
        pause_mode=PauseMode(pause_mode),
        hold_limit_s=hold_limit_s,
    )
