"""The weight versions of every completion, written into vLLM's answers (an ASGI middleware).

On `/v1/completions` and `/v1/chat/completions` (`VERSIONED_PATHS`):
- a JSON answer gets, on each choice, `weight_versions`: `[{"version", "start", "end"}, ...]`,
  the spans of output token indexes and the weight version that sampled them (one span when one
  version produced every token), and the header `X-Weight-Version`: per choice the version, or
  each version with the index of its first token (`3` or `3@0,4@117`), choices separated by `;`;
- a stream (`text/event-stream`): each chunk that ends a choice (its `finish_reason` set) carries
  that choice's `weight_versions` (the whole output's spans, as vLLM's own token-in-token-out
  route gives them); chunks before it carry none;
- a choice generated with a named adapter (`model: "<adapter>"`, served from a slot) gets
  `adapter`: `{"name", "version"}` (the adapter's version label, `"3,4"` when a refit of the
  adapter committed while it ran), and a JSON answer the header `X-Adapter-Version`: per choice
  `name:version`, choices separated by `;` (a stream: on the chunk that ends the choice);
- a request that the engine aborted (`finish_reason` "abort", which reaches a caller only when a
  refit with `--pause-mode abort` ended it) is answered 503 with `Retry-After` and a message
  saying to retry; a stream gets an `error` object on the chunk that ends it.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from generator_svc.server.token_versions import RESPONSE, AdapterUse, ResponseVersions, Span, label
from generator_svc.settings import PauseMode
from syncd.error_body import error_body, error_response

VERSIONED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
HEADER = "x-weight-version"
ADAPTER_HEADER = "x-adapter-version"


def aborted_message(pause_mode: PauseMode) -> str:
    if pause_mode is PauseMode.ABORT:
        return (
            "generation was aborted by a weight refit (this generator runs --pause-mode abort); "
            "retry the request"
        )
    return "generation was aborted by the engine; retry the request"


class WeightVersionsMiddleware:
    def __init__(self, app: ASGIApp, pause_mode: PauseMode, retry_after_s: int) -> None:
        self.app = app
        self.pause_mode = pause_mode
        self.retry_after_s = retry_after_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in VERSIONED_PATHS:
            await self.app(scope, receive, send)
            return
        response = ResponseVersions()
        token = RESPONSE.set(response)
        writer = _Writer(send, response, aborted_message(self.pause_mode))
        try:
            await self.app(scope, receive, writer.send)
        finally:
            RESPONSE.reset(token)
        if writer.aborted:
            headers = {"Retry-After": str(self.retry_after_s)}
            await error_response(writer.aborted, 503, headers=headers)(scope, receive, send)


class _Writer:
    """Holds a JSON answer until it is whole, then sends it with the versions (or leaves it to the
    middleware's 503 when a choice was aborted); passes a stream on chunk by chunk."""

    def __init__(self, send: Send, response: ResponseVersions, aborted_message: str) -> None:
        self._send = send
        self._response = response
        self._aborted_message = aborted_message
        self._start: Message | None = None
        self._stream = False
        self._body: list[bytes] = []
        self.aborted = ""

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = dict(message.get("headers", []))
            self._stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            if self._stream:
                await self._send(message)
            else:
                self._start = message
            return
        if message["type"] != "http.response.body":
            await self._send(message)
            return
        if self._stream:
            body = _versioned_events(message.get("body", b""), self._response, self._aborted_message)
            await self._send({**message, "body": body})
            return
        self._body.append(message.get("body", b""))
        if not message.get("more_body", False):
            await self._finish_json()

    async def _finish_json(self) -> None:
        assert self._start is not None, "a body before the response start"
        body = b"".join(self._body)
        start = self._start
        if start["status"] == 200:
            answer = _parsed(body)
            if isinstance(answer, dict) and isinstance(answer.get("choices"), list):
                if any(c.get("finish_reason") == "abort" for c in answer["choices"]):
                    self.aborted = self._aborted_message  # the middleware answers 503
                    return
                choices = _add_spans(answer["choices"], self._response.spans)
                adapters = _add_adapters(answer["choices"], self._response.adapters)
                body = json.dumps(answer).encode()
                headers = [(k, v) for k, v in start.get("headers", []) if k != b"content-length"]
                headers += [
                    (b"content-length", str(len(body)).encode()),
                    (HEADER.encode(), ";".join(label(s) if s is not None else "" for s in choices).encode()),
                ]
                if any(adapters):
                    line = ";".join(f"{a.name}:{a.version}" if a else "" for a in adapters)
                    headers.append((ADAPTER_HEADER.encode(), line.encode()))
                start = {**start, "headers": headers}
        await self._send(start)
        await self._send({"type": "http.response.body", "body": body, "more_body": False})


def _parsed(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


def _add_spans(choices: list[dict], spans: dict[int, list[Span]]) -> list[list[Span] | None]:
    """Set each choice's `weight_versions`; returns them in choice order (None: not recorded)."""
    out = []
    for position, choice in enumerate(choices):
        found = spans.get(choice.get("index", position))
        choice["weight_versions"] = None if found is None else [asdict(s) for s in found]
        out.append(found)
    return out


def _add_adapters(choices: list[dict], adapters: dict[int, AdapterUse]) -> list[AdapterUse | None]:
    """Set `adapter` on each choice made with a named adapter; returns them in choice order."""
    out = []
    for position, choice in enumerate(choices):
        used = adapters.get(choice.get("index", position))
        if used is not None:
            choice["adapter"] = asdict(used)
        out.append(used)
    return out


def _versioned_events(body: bytes, response: ResponseVersions, aborted_message: str) -> bytes:
    """The SSE events of `body` with `weight_versions` (and `adapter`) on each chunk that ends a choice."""
    spans = response.spans
    events = []
    for event in body.split(b"\n\n"):
        if not event.startswith(b"data: {"):
            events.append(event)
            continue
        chunk = _parsed(event[len(b"data: ") :])
        if not isinstance(chunk, dict) or not isinstance(chunk.get("choices"), list):
            events.append(event)
            continue
        ended = [c for c in chunk["choices"] if c.get("finish_reason") is not None]
        if not ended:
            events.append(event)
            continue
        for choice in ended:
            found = spans.get(choice.get("index", 0))
            choice["weight_versions"] = None if found is None else [asdict(s) for s in found]
        _add_adapters(ended, response.adapters)
        if any(c["finish_reason"] == "abort" for c in ended):
            chunk["error"] = error_body(aborted_message, 503)["error"]
        events.append(b"data: " + json.dumps(chunk).encode())
    return b"\n\n".join(events)
