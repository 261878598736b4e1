"""Build and run the service: vLLM's async engine and OpenAI app, our worker setup and routes."""

from __future__ import annotations

import asyncio
import logging
from argparse import Namespace

from generator_svc.server.refit import Refitter
from generator_svc.settings import EngineStart, Settings
from syncd.net import HTTP_KEEP_ALIVE_S

log = logging.getLogger("generator_svc")


async def serve(settings: Settings, args: Namespace) -> int:
    """Start the engine, set up weight sync on every worker, then serve HTTP until shutdown.
    Returns the exit status: 1 when the engine died (generator_svc.server.engine_health), else 0."""
    from generator_svc.server import request_guard, routes, token_versions
    from generator_svc.server.engine_health import keep_http_up_after_engine_death
    from generator_svc.server.engine_start import start_engines_by_fork
    from generator_svc.server.leave_on_shutdown import leave_syncd_before_shutdown
    from generator_svc.vllm_adapter import (
        build_app,
        build_async_engine_client,
        envs,
        init_app_state,
        serve_http,
        setup_server,
    )

    listen_address, sock = setup_server(args, reuse_port=False)
    if settings.engine_start is EngineStart.FORK:
        start_engines_by_fork(listening=sock)
    try:
        async with build_async_engine_client(args) as engine:
            refitter = Refitter(engine, settings)
            token_versions.track(engine, refitter.history.finished, refitter.adapters.version)
            workers = await refitter.setup(internal_url=f"http://127.0.0.1:{args.port}/internal")
            log.info(
                "weight sync ready on %d worker(s): %s; their status in %s",
                len(workers),
                [w.member_id for w in workers],
                refitter.status_dir,
            )
            if settings.syncd:  # before `request_guard.install`, whose engine watch must see a shutdown first
                leave_syncd_before_shutdown(engine, asyncio.get_running_loop())
            tasks = await engine.get_supported_tasks()
            app = build_app(args, tasks, engine.model_config)
            routes.install(app, refitter)  # before init_app_state: the middleware stack freezes there
            watch = request_guard.install(app, engine, engine.model_config, settings)
            keep_http_up_after_engine_death()
            watch_task = asyncio.create_task(watch.run())
            await init_app_state(engine, app.state, args, tasks)
            log.info("generator_svc serving on %s", listen_address)
            shutdown = await serve_http(
                app,
                sock=sock,
                host=args.host,
                port=args.port,
                log_level=args.uvicorn_log_level,
                access_log=not args.disable_uvicorn_access_log,
                # vLLM's default is uvicorn's 5 s, which races clients' pools (syncd.net).
                timeout_keep_alive=(
                    envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
                    if envs.is_set("VLLM_HTTP_TIMEOUT_KEEP_ALIVE")
                    else HTTP_KEEP_ALIVE_S
                ),
            )
        await shutdown
        watch_task.cancel()
        return 1 if watch.cause else 0
    finally:
        sock.close()
