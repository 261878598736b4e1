"""syncd's one settings object. Every setting is declared once below, with its flag, environment
variable and default; precedence is flag > environment > default.

    python -m syncd --http-port 8470 --grpc-port 8471 --db /var/lib/syncd/syncd.db
    python -m syncd --host 0.0.0.0 --auth-token-file /run/secrets/syncd-token

syncd binds loopback unless told otherwise, and refuses to bind anything else without a token
(`--auth-token-file`, `--auth-token`) unless `--insecure-no-auth` says to serve open: a daemon
that hands out a model's weights is not open to a network by accident (docs/security.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from syncd.auth import ENV_TOKEN, ENV_TOKEN_FILE, Access, is_loopback, read_token_file
from syncd.vocabulary import Backend, SameHost


def _setting(default: Any, env: str, help: str) -> Any:
    return field(default=default, metadata={"env": env, "help": help})


@dataclass(frozen=True)
class Settings:
    host: str = _setting(
        "127.0.0.1",
        "SYNCD_HOST",
        "address both servers bind; one other than loopback needs a token or --insecure-no-auth",
    )
    http_port: int = _setting(8470, "SYNCD_HTTP_PORT", "HTTP (operator API, /metrics) port")
    grpc_port: int = _setting(8471, "SYNCD_GRPC_PORT", "gRPC (member API) port")
    db: str = _setting("syncd.db", "SYNCD_DB", "SQLite file holding refit history and committed version")
    auth_token: str | None = _setting(
        None, ENV_TOKEN, "when set, mutating HTTP calls and all member RPCs need 'Bearer <token>'"
    )
    store_busy_timeout: float = _setting(
        5.0,
        "SYNCD_STORE_BUSY_TIMEOUT",
        "seconds a store write waits for SQLite's lock (3 attempts); refits never wait for it",
    )
    auth_token_file: str | None = _setting(
        None,
        ENV_TOKEN_FILE,
        "file holding the token (e.g. a mounted Secret), so it never shows in /proc/PID/cmdline",
    )
    insecure_no_auth: bool = _setting(
        False,
        "SYNCD_INSECURE_NO_AUTH",
        "serve without a token on an address other than loopback: anyone who reaches syncd may "
        "trigger refits or join as a member (said at start, in /v1/status and in a metric)",
    )
    lease_seconds: float = _setting(10.0, "SYNCD_LEASE_SECONDS", "member lease; renewed by heartbeats")
    prepare_timeout: float = _setting(120.0, "SYNCD_PREPARE_TIMEOUT", "seconds for PREPARING (plan + groups)")
    transfer_timeout: float = _setting(600.0, "SYNCD_TRANSFER_TIMEOUT", "seconds for TRANSFERRING")
    verify_timeout: float = _setting(60.0, "SYNCD_VERIFY_TIMEOUT", "seconds for VERIFYING")
    commit_timeout: float = _setting(60.0, "SYNCD_COMMIT_TIMEOUT", "seconds for committing")
    bucket_bytes: int = _setting(256 << 20, "SYNCD_BUCKET_BYTES", "planner bucket size in bytes")
    fanout: int = _setting(
        1,
        "SYNCD_FANOUT",
        "replicas of one layout relay buckets to at most this many others (1: a chain; 0: each "
        "replica from the trainers), so the trainers send one copy per layout",
    )
    stall_timeout: float = _setting(
        30.0,
        "SYNCD_STALL_TIMEOUT",
        "seconds one data-plane send or receive may wait before its member aborts the refit naming "
        "the peer as slow or stuck",
    )
    refit_retries: int = _setting(
        1,
        "SYNCD_REFIT_RETRIES",
        "1: a refit that lost generator replicas (dead, cut off) is retried once over the survivors "
        "after the lease ran out; 0: never",
    )
    min_replicas_per_layout: int = _setting(
        1,
        "SYNCD_MIN_REPLICAS_PER_LAYOUT",
        "once every expected generator registered, refits go on without missing replicas while "
        "each generator layout keeps at least this many whole replicas registered",
    )
    expected_trainers: int = _setting(1, "SYNCD_EXPECTED_TRAINERS", "trainer ranks needed to be ready")
    expected_generators: int = _setting(
        1, "SYNCD_EXPECTED_GENERATORS", "generator workers needed to be ready"
    )
    same_host: SameHost = _setting(  # noqa: RUF009 - the default is a StrEnum member, immutable
        SameHost.SHM,
        "SYNCD_SAME_HOST",
        "links between members that report the same host: shm (shared memory in gloo groups; "
        "CUDA IPC in NCCL groups whose members all share memory) or network (the group's "
        "backend, as between hosts)",
    )
    backend: str = _setting(
        "auto", "SYNCD_BACKEND", "data-plane backend: auto (nccl if all cuda), gloo, nccl"
    )
    auto_refit: bool = _setting(
        False, "SYNCD_AUTO_REFIT", "start a refit whenever a trainer announces a version"
    )
    max_message_bytes: int = _setting(
        64 << 20,
        "SYNCD_MAX_MESSAGE_BYTES",
        "largest gRPC message syncd reads; read only after the token was checked",
    )
    max_catalog_entries: int = _setting(
        1_000_000, "SYNCD_MAX_CATALOG_ENTRIES", "canonical tensors + local tensors + pieces per catalog"
    )
    max_tensor_elements: int = _setting(
        1 << 40, "SYNCD_MAX_TENSOR_ELEMENTS", "elements of one canonical or local tensor"
    )
    max_plan_buckets: int = _setting(
        1_000_000, "SYNCD_MAX_PLAN_BUCKETS", "buckets a plan may need (received bytes / bucket bytes)"
    )
    max_watch_streams: int = _setting(
        2, "SYNCD_MAX_WATCH_STREAMS", "open Watch streams per member session (each holds a gRPC thread)"
    )
    delta_refits: bool = _setting(
        False,
        "SYNCD_DELTA_REFITS",
        "send generators that hold the committed version only the elements that changed (trainer ranks "
        "then keep a copy of what they sent, in the generators' dtype; off by default for that memory)",
    )
    delta_inplace: bool = _setting(
        False,
        "SYNCD_DELTA_INPLACE",
        "with delta refits on, send deltas to inplace generators too (each must run with "
        "--inplace-delta-base: a checkpoint-format copy of the layers vLLM post-processes)",
    )
    delta_max_fraction: float = _setting(
        0.5,
        "SYNCD_DELTA_MAX_FRACTION",
        "a bucket goes dense when its delta would be more than this fraction of its dense bytes",
    )
    log_level: str = _setting("INFO", "SYNCD_LOG_LEVEL", "logging level")

    def __post_init__(self) -> None:
        if self.auth_token_file is not None:
            if self.auth_token is not None:
                raise ValueError(
                    f"both a token file ({self.auth_token_file!r}) and a token were given "
                    f"(--auth-token-file or {ENV_TOKEN_FILE}, and --auth-token or {ENV_TOKEN}): give one"
                )
            object.__setattr__(self, "auth_token", read_token_file(self.auth_token_file))
        self._check_access()
        if self.same_host not in tuple(SameHost):
            raise ValueError(f"same_host must be shm or network, not {self.same_host!r}")
        object.__setattr__(self, "same_host", SameHost(self.same_host))  # flags and env give text
        if self.backend not in ("auto", *Backend):
            raise ValueError(f"backend must be auto, gloo or nccl, not {self.backend!r}")
        for name in (
            "store_busy_timeout",
            "lease_seconds",
            "prepare_timeout",
            "transfer_timeout",
            "verify_timeout",
            "commit_timeout",
            "stall_timeout",
            "bucket_bytes",
            "max_message_bytes",
            "max_catalog_entries",
            "max_tensor_elements",
            "max_plan_buckets",
            "max_watch_streams",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)}")
        if self.refit_retries not in (0, 1):
            raise ValueError(f"refit_retries must be 0 or 1, not {self.refit_retries}")
        if self.fanout < 0:
            raise ValueError(f"fanout must be 0 (off) or a positive fan-out, not {self.fanout}")
        if not 0 < self.delta_max_fraction <= 1:
            raise ValueError(f"delta_max_fraction must be in (0, 1], not {self.delta_max_fraction}")
        if self.min_replicas_per_layout < 1:
            raise ValueError(f"min_replicas_per_layout must be >= 1, not {self.min_replicas_per_layout}")
        if self.expected_trainers < 1 or self.expected_generators < 1:
            raise ValueError(
                f"expected_trainers and expected_generators must be >= 1, not "
                f"{self.expected_trainers} and {self.expected_generators}"
            )

    def _check_access(self) -> None:
        if self.insecure_no_auth and self.auth_token is not None:
            raise ValueError("--insecure-no-auth with a token: give one or the other")
        if self.auth_token is None and not self.insecure_no_auth and not is_loopback(self.host):
            raise ValueError(
                f"refusing to serve on {self.host} without a token: anyone who reaches it could "
                f"trigger refits or register as a generator and be sent the weights. Give "
                f"--auth-token-file FILE (env {ENV_TOKEN_FILE}) or --auth-token (env {ENV_TOKEN}); "
                f"or bind loopback (--host 127.0.0.1); or pass --insecure-no-auth to serve open anyway"
            )

    @property
    def access(self) -> Access:
        """Who may call syncd's mutating HTTP routes and member RPCs."""
        if self.auth_token is not None:
            return Access.TOKEN
        return Access.INSECURE_NO_AUTH if self.insecure_no_auth else Access.LOOPBACK

    @classmethod
    def load(cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
        environ = os.environ if environ is None else environ
        parser = argparse.ArgumentParser(prog="syncd", description="weight-sync daemon")
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            if f.type == "bool":
                parser.add_argument(
                    flag,
                    action=argparse.BooleanOptionalAction,
                    default=None,
                    help=f"{f.metadata['help']} (env {f.metadata['env']})",
                )
            else:
                parser.add_argument(
                    flag,
                    default=None,
                    help=f"{f.metadata['help']} (env {f.metadata['env']}, default {f.default})",
                )
        args = vars(parser.parse_args(argv))
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = args[f.name] if args[f.name] is not None else environ.get(f.metadata["env"])
            if raw is not None:
                values[f.name] = _parse(f.name, str(f.type), raw)  # a name: annotations are strings here
        return cls(**values)

    @staticmethod
    def env_vars() -> dict[str, str]:
        return {f.name: f.metadata["env"] for f in dataclasses.fields(Settings)}


def _parse(name: str, kind: str, raw: Any) -> Any:
    if isinstance(raw, bool):
        return raw
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
    except ValueError:
        raise ValueError(f"setting {name}: {raw!r} is not a {kind}") from None
    if kind == "bool":
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"setting {name}: {raw!r} is not a boolean")
    return raw or None if name in ("auth_token", "auth_token_file") else raw
