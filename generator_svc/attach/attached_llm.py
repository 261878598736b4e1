"""Weight sync for a vLLM engine the user creates: here an in-process `LLM` (`attach`); a `vllm serve`
process takes it through `serve_middleware` and `serve_client`.

    from vllm import LLM
    from generator_svc import attach

    llm = LLM(model=..., **attach.ENGINE_ARGS)            # the worker extension, the transfer engine
    handle = attach.attach(llm, syncd="syncd-host:8471", replica=0)
    served = handle.wait_version(3, timeout_s=600)        # step 3 or newer is served: a Version
    llm.generate(...)                                      # as before; refits come and go
    handle.close()                                         # leave syncd; the weights stay

    python -m vllm.entrypoints.openai.api_server --model M ... $(python -m generator_svc.attach)
    attach.attach_server("http://host:8000", syncd="syncd-host:8471", replica=1)

What attaching does is what `python -m generator_svc` does at start, on an engine someone else
built: every worker builds its catalog and registers with syncd as `generator-{replica}-{tp}`
(`ws_setup` of the worker extension), and the process holding the engine client runs the refit
lifecycle of `generator_svc.server.refit` (`Refitter`: verified staging, pause, install by parameter,
prefix-cache reset, resume, weight version; or the `inplace` mode) when the tp-0 worker relays
syncd's Commit to it over loopback HTTP (`server.routes.internal_router`, authenticated with a token only
the workers got). Where that runs:

- `LLM`: a thread of this process, with an event loop of its own, serves the relay routes on a
  loopback port and drives the `LLM` through `offline_engine.OfflineEngineClient` (utility calls to the engine
  core process, the scheduler paused around the install), while the owner generates at will. A
  failed install leaves the scheduler paused (generation waits) until a complete refit: an
  attached `LLM` never generates with torn weights.
- `vllm serve`: vLLM's own API server process, through the ASGI middleware of
  `generator_svc.attach.serve_middleware` (`--middleware`), which also answers 503 to generation while the
  weights may be torn. `attach_server` (`serve_client`) asks it to attach (`POST /weightsync/attach`).

Refusals (`AttachRefused`, `engine_args`, before any worker registers): an engine built without the worker
extension (`worker_extension_cls`, or a subclass of it) or the weight-transfer engine
(`weight_transfer_config`), naming the engine argument and its flag; an `LLM` whose engine core
runs in the caller's thread (`VLLM_ENABLE_V1_MULTIPROCESSING=0`); a server without the middleware.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

from generator_svc.attach.engine_args import AttachRefused, make_settings, refuse_unless_attachable
from generator_svc.server.refit import Refitter
from generator_svc.server.version_wait import wait_served
from generator_svc.settings import Settings
from generator_svc.worker_protocol import WorkerInfo
from syncd.net import HTTP_KEEP_ALIVE_S
from syncd.weight_version import Version


class AttachedEngine:
    """An attached `LLM`: what it serves, and `close`. Its refits run on a thread of their own."""

    def __init__(self, llm: Any, control: _ControlThread) -> None:
        self._llm, self._control = llm, control

    @property
    def refitter(self) -> Refitter:
        assert self._control.refitter is not None  # set before `attach` returns
        return self._control.refitter

    @property
    def version(self) -> Version:
        """The weights served: syncd's label (a trainer step's decimal digits once a refit
        committed, else the `initial_version` label) and the step it names."""
        return Version.of_label(self.refitter.version)

    @property
    def serving(self) -> bool:
        """False after a failed install, until a complete refit (generation waits meanwhile)."""
        return self.refitter.serving

    @property
    def workers(self) -> list[WorkerInfo]:
        """Per worker: member id, tp rank, catalog hash, bytes."""
        return self.refitter.workers

    def wait_version(
        self, version: int | str | Version, *, exact: bool = False, timeout_s: float = 600.0
    ) -> Version:
        """Return the version served once it is `version` (a trainer step, a label or a `Version`)
        or a newer step: a trainer ahead of its rollouts commits versions nobody waits for.
        `exact`: that version only. Raises TimeoutError naming both versions after `timeout_s`."""
        return wait_served(lambda: self.refitter.version, Version.of(version), exact, timeout_s)

    def close(self) -> None:
        """Leave syncd and stop taking refits; the engine keeps the weights it holds."""
        self._control.stop()
        self._llm.collective_rpc("ws_close")


def attach(llm: Any, *, syncd: str, replica: int = 0, **options: Any) -> AttachedEngine:
    """Make `llm` (vLLM's `LLM`, built with `ENGINE_ARGS`) a syncd member as replica `replica`.
    `options`: `make_settings`'s keywords (refit_mode, pause_mode, auth_token, data_host, ...).
    Raises AttachRefused naming a missing engine argument, before anything registers."""
    from generator_svc.attach.offline_engine import OfflineEngineClient
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
    control = _ControlThread(OfflineEngineClient(llm, client), settings)
    control.start()
    return AttachedEngine(llm, control)


class _ControlThread:
    """A thread with an event loop: the `Refitter` of an attached `LLM` and the routes its tp-0
    worker relays syncd's commands to (`server.routes.internal_router`, on 127.0.0.1, a port of its own).
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

        from generator_svc.server.routes import internal_router

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
