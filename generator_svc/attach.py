"""Weight sync for a vLLM engine the user creates: an in-process `LLM`, or a `vllm serve` process.

    from vllm import LLM
    from generator_svc import attach

    llm = LLM(model=..., **attach.ENGINE_ARGS)            # the worker extension, the transfer engine
    handle = attach.attach(llm, syncd="syncd-host:8471", replica=0)
    handle.wait_version(3, timeout_s=600)                 # the trainer's step 3 is served
    llm.generate(...)                                      # as before; refits come and go
    handle.close()                                         # leave syncd; the weights stay

    python -m vllm.entrypoints.openai.api_server --model M ... $(python -m generator_svc.attach)
    attach.attach_server("http://host:8000", syncd="syncd-host:8471", replica=1)

What attaching does is what `python -m generator_svc` does at start, on an engine someone else
built: every worker builds its catalog and registers with syncd as `generator-{replica}-{tp}`
(`ws_setup` of the worker extension), and the process holding the engine client runs the refit
lifecycle of `generator_svc.refit` (`Refitter`: verified staging, pause, install by parameter,
prefix-cache reset, resume, weight version; or the `inplace` mode) when the tp-0 worker relays
syncd's Commit to it over loopback HTTP (`server.internal_router`, authenticated with a token only
the workers got). Where that runs:

- `LLM`: a thread of this process, with an event loop of its own, serves the relay routes on a
  loopback port and drives the `LLM` through `sync_engine.SyncEngine` (utility calls to the engine
  core process, the scheduler paused around the install), while the owner generates at will. A
  failed install leaves the scheduler paused (generation waits) until a complete refit: an
  attached `LLM` never generates with torn weights.
- `vllm serve`: vLLM's own API server process, through the ASGI middleware of
  `generator_svc.attach_serve` (`--middleware`), which also answers 503 to generation while the
  weights may be torn. `attach_server` asks it to attach (`POST /weightsync/attach`).

Refusals (`AttachRefused`, before any worker registers): an engine built without the worker
extension (`worker_extension_cls`, or a subclass of it) or the weight-transfer engine
(`weight_transfer_config`), naming the engine argument and its flag; an `LLM` whose engine core
runs in the caller's thread (`VLLM_ENABLE_V1_MULTIPROCESSING=0`); a server without the middleware.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import socket
import sys
import threading
import time
from typing import Any

import httpx

from generator_svc.refit import Refitter
from generator_svc.settings import IN_FLIGHT_DEFAULT, WORKER_EXTENSION, PauseMode, RefitMode, Settings
from generator_svc.transfer_engine import BACKEND
from syncd.auth import resolve_token
from syncd.net import HTTP_KEEP_ALIVE_S

ENGINE_ARGS: dict[str, Any] = {
    "worker_extension_cls": WORKER_EXTENSION,
    "weight_transfer_config": {"backend": BACKEND},
}
MIDDLEWARE = "generator_svc.attach_serve.WeightSyncMiddleware"
SERVE_FLAGS: list[str] = [
    "--worker-extension-cls",
    WORKER_EXTENSION,
    "--weight-transfer-config",
    json.dumps({"backend": BACKEND}, separators=(",", ":")),  # one shell word
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
    if backend != BACKEND:
        given = "not set" if backend is None else f"backend {backend!r}"
        problems.append(
            f"weight_transfer_config (--weight-transfer-config) is {given}: weight sync needs "
            f"{{'backend': {BACKEND!r}}}"
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
    refit_mode: str = RefitMode.STAGED.value,
    pause_mode: str = PauseMode.WAIT.value,
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


class AttachedEngine:
    """An attached `LLM`: what it serves, and `close`. Its refits run on a thread of their own."""

    def __init__(self, llm: Any, control: _ControlThread) -> None:
        self._llm, self._control = llm, control

    @property
    def refitter(self) -> Refitter:
        assert self._control.refitter is not None  # set before `attach` returns
        return self._control.refitter

    @property
    def version(self) -> str:
        """The label of the weights served: a trainer version's decimal digits once a refit
        committed, else the `initial_version` label."""
        return self.refitter.version

    @property
    def serving(self) -> bool:
        """False after a failed install, until a complete refit (generation waits meanwhile)."""
        return self.refitter.serving

    @property
    def workers(self) -> list[dict]:
        """Per worker: member id, tp rank, catalog hash, bytes."""
        return self.refitter.workers

    def wait_version(self, version: int | str, timeout_s: float = 600.0) -> None:
        """Return once the engine serves `version` (a trainer version or its label); raise
        TimeoutError naming both versions after `timeout_s`."""
        label = str(version)
        deadline = time.monotonic() + timeout_s
        while self.version != label:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the engine serves version {self.version!r}, not {label!r}, after {timeout_s:g} s"
                )
            time.sleep(0.05)

    def close(self) -> None:
        """Leave syncd and stop taking refits; the engine keeps the weights it holds."""
        self._control.stop()
        self._llm.collective_rpc("ws_close")


def attach(llm: Any, *, syncd: str, replica: int = 0, **options: Any) -> AttachedEngine:
    """Make `llm` (vLLM's `LLM`, built with `ENGINE_ARGS`) a syncd member as replica `replica`.
    `options`: `make_settings`'s keywords (refit_mode, pause_mode, auth_token, data_host, ...).
    Raises AttachRefused naming a missing engine argument, before anything registers."""
    from generator_svc.sync_engine import SyncEngine
    from generator_svc.vllm_adapter import engine_config, is_sync_llm, sync_engine_core

    if not is_sync_llm(llm):
        raise AttachRefused(
            f"attach takes vLLM's LLM, got {type(llm).__name__}; for a server use attach_server"
        )
    refuse_unless_attachable(engine_config(llm))
    client = sync_engine_core(llm)
    if client is None:
        raise AttachRefused(
            "VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core runs in the caller's thread, so refits "
            "could not pause it; attach needs vLLM's default engine core process"
        )
    settings = make_settings(syncd, replica, **options)
    control = _ControlThread(SyncEngine(llm, client), settings)
    control.start()
    return AttachedEngine(llm, control)


class _ControlThread:
    """A thread with an event loop: the `Refitter` of an attached `LLM` and the routes its tp-0
    worker relays syncd's commands to (`server.internal_router`, on 127.0.0.1, a port of its own).
    `start` returns once every worker registered (or raises what setting them up raised)."""

    def __init__(self, engine: Any, settings: Settings) -> None:
        self._engine, self._settings = engine, settings
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.refitter: Refitter | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._server: Any = None  # uvicorn.Server, made on the thread
        self._thread = threading.Thread(target=self._run, name="weightsync-control", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(timeout=30)

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        import uvicorn
        from fastapi import FastAPI

        from generator_svc.server import internal_router

        port = self._sock.getsockname()[1]
        refitter = Refitter(self._engine, self._settings)
        app = FastAPI(title="weightsync control (attached engine)")
        app.state.refitter = refitter
        app.include_router(internal_router)
        self._server = uvicorn.Server(
            uvicorn.Config(
                app,
                log_level="warning",
                log_config=None,
                lifespan="off",
                timeout_keep_alive=HTTP_KEEP_ALIVE_S,
            )
        )
        serving = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        try:
            await refitter.setup(internal_url=f"http://127.0.0.1:{port}/internal")
        except Exception as e:  # noqa: BLE001 - not swallowed: `start` raises it in the caller's thread
            self._error = e
            self._server.should_exit = True
            await serving
            return
        finally:
            self.refitter = refitter
            self._ready.set()
        await serving


def attach_server(
    url: str,
    *,
    syncd: str,
    replica: int = 0,
    api_key: str | None = None,
    timeout_s: float = 120.0,
    **options: Any,
) -> dict:
    """Attach the `vllm serve` process at `url` (started with `SERVE_FLAGS`) as replica `replica`
    of syncd `syncd`; `options` as for `attach`; `api_key` where the server has `--api-key`.
    Returns its answer (`workers`: member ids, tp ranks, catalog hashes). Raises AttachRefused
    naming what the server lacks."""
    make_settings(syncd, replica, **options)  # bad values fail here, before the server is asked
    body = {"syncd": syncd, "replica": replica, **options}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.post(f"{url.rstrip('/')}{ATTACH_ROUTE}", json=body, headers=headers, timeout=timeout_s)
    if response.status_code == 404:
        raise AttachRefused(
            f"{url} has no {ATTACH_ROUTE}: start it with --middleware {MIDDLEWARE} "
            f"(all of weight sync's flags: {' '.join(SERVE_FLAGS)})"
        )
    if response.status_code == 409:
        raise AttachRefused(response.json()["error"]["message"])
    response.raise_for_status()
    return response.json()


def main() -> int:
    """`python -m generator_svc.attach`: print the `vllm serve` flags weight sync needs."""
    print(" ".join(SERVE_FLAGS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
