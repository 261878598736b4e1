"""Which weight version produced which output tokens of a completion, from vLLM's own record.

vLLM 0.32 labels every batch of engine outputs with the engine's weight version (set by
`finish_weight_update(weight_version=...)`, which only runs while generation is paused) and gives
each finished `CompletionOutput` its `weight_versions`: contiguous spans `[start, end)` of output
token indexes and the version that sampled them. Its OpenAI routes drop them. This module keeps
them for generator_svc:

- `track(engine, on_finished)` wraps the engine's `generate` (an instance attribute, set once at
  startup): every finished output's spans go to `on_finished` (the refit history counts the
  requests that spanned each refit), and to the `ResponseVersions` of the HTTP response being
  built, when there is one;
- `ResponseVersions` is what one HTTP response collects, by choice index; the middleware of
  `generator_svc.server.versions_http` creates it (a context variable: vLLM's route handler runs inside
  the middleware's context) and writes it into the response.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Span:
    """Output tokens `[start, end)` were sampled with the weights labelled `version`."""

    version: str
    start: int
    end: int


def label(spans: list[Span]) -> str:
    """One line for a choice: the version when one version produced every token (`"3"`), else
    each version with the index of its first token (`"3@0,4@117"`); empty for no tokens."""
    if len({s.version for s in spans}) == 1:
        return spans[0].version
    return ",".join(f"{s.version}@{s.start}" for s in spans)


@dataclass(frozen=True)
class AdapterUse:
    """A choice generated with named adapter `name`, at `version` (its label when the request
    started and when it finished: `"3"`, or `"3,4"` when a refit of the adapter committed while it
    ran)."""

    name: str
    version: str


def adapter_label(started: str | None, finished: str | None) -> str:
    seen = [v for v in dict.fromkeys((started, finished)) if v is not None]
    return ",".join(seen)


@dataclass
class ResponseVersions:
    """The spans of one HTTP response's choices, by choice index. vLLM's completion route calls
    `generate` once per prompt, in prompt order, each with `n` choices: choice `i` of prompt `p`
    is response choice `p * n + i` (the route's own numbering)."""

    choices: int = 0  # choices of the engine requests made so far
    spans: dict[int, list[Span]] = field(default_factory=dict)
    adapters: dict[int, AdapterUse] = field(default_factory=dict)  # choices made with a named adapter

    def add_request(self, n: int) -> int:
        """Count an engine request with `n` choices; returns the index of its first choice."""
        first, self.choices = self.choices, self.choices + n
        return first


RESPONSE: ContextVar[ResponseVersions | None] = ContextVar("weightsync_response_versions", default=None)


def spans_of(output: Any) -> list[Span] | None:
    """The spans of a vLLM `CompletionOutput` (set on its final output only), None before."""
    spans = output.weight_versions
    return None if spans is None else [Span(s.version, s.start, s.end) for s in spans]


def track(
    engine: Any,
    on_finished: Callable[[list[Span]], None],
    adapter_version: Callable[[str], str | None] = lambda name: None,
) -> None:
    """Wrap `engine.generate` (vLLM's AsyncLLM) so that every finished output's spans reach
    `on_finished` and the response being built (`RESPONSE`), with the version of the named
    adapter it used (`adapter_version(name)`: the served adapters' label, None for none)."""
    original = engine.generate

    def generate(prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        # Runs when the route calls generate (in prompt order), not when it iterates.
        response = RESPONSE.get()
        first = response.add_request(getattr(sampling_params, "n", 1) or 1) if response else 0
        lora = kwargs.get("lora_request")
        adapter = None  # adapters served from slots only: those have versions
        if lora is not None and (started := adapter_version(lora.lora_name)) is not None:
            adapter = _AdapterWatch(lora.lora_name, started, adapter_version)
        outputs = original(prompt, sampling_params, request_id, *args, **kwargs)
        return _recorded(outputs, response, first, on_finished, adapter)

    engine.generate = generate


class _AdapterWatch:
    """The version of one request's named adapter when it started; `use()` when it finished."""

    def __init__(self, name: str, started: str, version: Callable[[str], str | None]) -> None:
        self.name, self.started, self._version = name, started, version

    def use(self) -> AdapterUse:
        return AdapterUse(self.name, adapter_label(self.started, self._version(self.name)))


async def _recorded(
    outputs: Any,
    response: ResponseVersions | None,
    first: int,
    on_finished: Callable[[list[Span]], None],
    adapter: _AdapterWatch | None = None,
) -> AsyncIterator[Any]:
    # aclosing: a client that goes away closes this generator, and vLLM's generate must see it
    # closed too (it aborts the request in its own `finally`).
    async with contextlib.aclosing(outputs) as request_outputs:
        async for request_output in request_outputs:
            for output in getattr(request_output, "outputs", ()):
                if (spans := spans_of(output)) is not None:
                    on_finished(spans)
                    if response is not None:
                        response.spans[first + output.index] = spans
                        if adapter is not None:
                            response.adapters[first + output.index] = adapter.use()
            yield request_output
