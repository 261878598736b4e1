"""The guard in front of vLLM's generation routes (an ASGI middleware, outermost of the app).

Per request to a route that reaches the engine (`ENGINE_PATHS`), in this order:
1. the engine is dead: 503, saying so (`engine_health`), instead of vLLM's 500 on every request;
2. the body is larger than `--max-request-bytes`: 413 (read no further);
3. the JSON body carries what must not reach the engine: 400 naming the field and the value
   (`request_limits`);
4. a route that takes text (chat, responses, messages) on a generator without a tokenizer
   (`--skip-tokenizer-init`, as the demo and tests run it): 400 saying to send token ids to
   /v1/completions, where vLLM would answer an empty 500;
5. all slots busy and the queue full: 429 with `Retry-After` (`admission`); otherwise the request
   waits for a slot and holds it until its response (streamed or not) has been sent.
Every refusal is counted in `weightsync_generator_rejected_requests{reason}` and answered in the
project's error body (`syncd.error_body`). Other routes pass untouched.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from generator_svc.server import metrics
from generator_svc.server.admission import Admission, OverloadedError
from generator_svc.server.engine_health import EngineClient, EngineWatch
from generator_svc.server.request_limits import BadRequestError, RequestLimits, check_request
from syncd.error_body import error_response

if TYPE_CHECKING:
    from fastapi import FastAPI

    from generator_svc.settings import Settings

log = logging.getLogger("generator_svc.server.request_guard")
# vLLM's routes that submit requests to the engine (/invocations is SageMaker's alias of
# completions and chat).
TEXT_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/chat/completions/batch",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
    }
)
ENGINE_PATHS = TEXT_PATHS | {
    "/v1/completions",
    "/invocations",
    "/generative_scoring",
    "/inference/v1/generate",
}


@dataclass
class Guard:
    """What the middleware consults; one per app."""

    limits: RequestLimits
    admission: Admission
    watch: EngineWatch
    max_request_bytes: int
    retry_after_s: int
    has_tokenizer: bool


class _BodyTooLargeError(Exception):
    pass


class GenerationGuard:
    def __init__(self, app: ASGIApp, guard: Guard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in ENGINE_PATHS:
            await self.app(scope, receive, send)
            return
        g = self.guard
        if g.watch.dead:
            await self._refuse(
                scope, receive, send, metrics.RejectReason.ENGINE_DEAD, 503, _engine_dead_message(g.watch)
            )
            return
        try:
            body = await _read_body(scope, receive, g.max_request_bytes)
        except _BodyTooLargeError:
            message = f"request body: larger than --max-request-bytes {g.max_request_bytes}"
            await self._refuse(scope, receive, send, metrics.RejectReason.TOO_LARGE, 413, message)
            return
        try:
            check_request(scope["path"], _parsed(body), g.limits)
        except BadRequestError as e:
            log.info("refused %s: %s", scope["path"], e)
            await self._refuse(scope, receive, send, metrics.RejectReason.INVALID, 400, str(e))
            return
        if scope["path"] in TEXT_PATHS and not g.has_tokenizer:
            message = (
                f"{scope['path']} takes text, and this generator runs without a tokenizer "
                "(--skip-tokenizer-init): send token ids to /v1/completions"
            )
            await self._refuse(scope, receive, send, metrics.RejectReason.INVALID, 400, message)
            return
        try:
            async with g.admission.slot():
                await self.app(scope, _replay(body, receive), send)
        except OverloadedError as e:
            await self._refuse(
                scope, receive, send, metrics.RejectReason.OVERLOADED, 429, f"overloaded: {e}; retry later"
            )

    async def _refuse(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        reason: metrics.RejectReason,
        status: int,
        message: str,
    ) -> None:
        metrics.REJECTED_REQUESTS.labels(reason=reason).inc()
        headers = {"Retry-After": str(self.guard.retry_after_s)} if status in (429, 503) else None
        await error_response(message, status, headers=headers)(scope, receive, send)


def _engine_dead_message(watch: EngineWatch) -> str:
    cause = f" ({watch.cause})" if watch.cause else ""
    return (
        f"the vLLM engine of this generator has died{cause}; "
        "it exits to be restarted: retry on another generator or later"
    )


async def _read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise _BodyTooLargeError
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away; vLLM's handler sees it too
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _BodyTooLargeError
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _parsed(body: bytes) -> object:
    """The JSON body as FastAPI will parse it for vLLM's handler; None when it is not JSON (then
    vLLM's request model answers the 400); BadRequestError when it is nested too deeply to parse."""
    try:
        return json.loads(body)
    except ValueError:
        return None
    except RecursionError:  # FastAPI's own parse would fail the same way, as a 500
        raise BadRequestError("request body: JSON nested too deeply") from None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands the app the body already read, then passes on (disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def install(
    app: FastAPI, engine: EngineClient, model_config: Any, settings: Settings
) -> EngineWatch:  # vllm.config.ModelConfig
    """Put the guard in front of `app` (vLLM's OpenAI app, before its middleware stack is built)
    with the bounds of `model_config` (the engine's) and `settings`; return the engine watch, whose
    `run()` the caller starts."""
    limits = RequestLimits(
        vocab_size=model_config.get_vocab_size(),
        max_model_len=model_config.max_model_len,
        max_logprobs=model_config.max_logprobs,
        max_n=settings.max_n,
        max_prompts=settings.max_prompts,
    )
    watch = EngineWatch(engine, settings.engine_death_exit_s)
    admission = Admission(settings.max_concurrent_requests, settings.max_queued_requests)
    guard = Guard(
        limits,
        admission,
        watch,
        settings.max_request_bytes,
        settings.retry_after_s,
        has_tokenizer=not model_config.skip_tokenizer_init,
    )
    app.middleware_stack = None  # vLLM's build_app built it; Starlette rebuilds it with ours
    app.add_middleware(GenerationGuard, guard=guard)
    log.info(
        "generation guard: %s, %d concurrent + %d queued requests, bodies <= %d bytes",
        limits,
        admission.max_concurrent,
        admission.max_queued,
        settings.max_request_bytes,
    )
    return watch
