"""The weight versions written into completion answers (`generator_svc.server.versions_http`), with a
stand-in for vLLM's engine and route (no vLLM here: `tests/generator/test_pause_modes.py` runs the
real one). What is checked is the middleware's mapping of engine requests to choices, the header,
the stream's last chunks and the abort's 503."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from generator_svc.server import token_versions
from generator_svc.server.token_versions import Span, label
from generator_svc.server.versions_http import WeightVersionsMiddleware
from generator_svc.settings import PauseMode

# Per prompt: per choice, the spans the engine reports when it finishes.
SPANS = {
    7: [[Span("3", 0, 4)], [Span("3", 0, 2), Span("4", 2, 4)]],
    8: [[Span("4", 0, 4)], [Span("4", 0, 4)]],
}


class Engine:
    """vLLM's `generate` as the routes see it: final outputs with `weight_versions`."""

    def __init__(self, finish_reason: str = "length", on_generate: Any = None) -> None:
        self.finish_reason = finish_reason
        self.finished: list[list[Span]] = []
        self.on_generate = on_generate  # runs while a request generates (a refit committing meanwhile)

    async def generate(
        self, prompt: int, sampling_params: Any, request_id: str, lora_request: Any = None
    ) -> Any:
        if self.on_generate is not None:
            self.on_generate()
        outputs = [
            SimpleNamespace(index=i, weight_versions=spans, finish_reason=self.finish_reason)
            for i, spans in enumerate(SPANS[prompt])
        ]
        yield SimpleNamespace(outputs=outputs)


def _app(engine: Engine, adapters: dict[str, str] | None = None) -> Starlette:
    """`adapters`: the named adapters served from slots, by name: their version labels."""
    token_versions.track(engine, engine.finished.append, (adapters or {}).get)

    async def run(prompts: list[int], model: str) -> list[dict]:
        # As vLLM's completion route: one engine request per prompt, n choices each, made in order;
        # a model other than the base names an adapter (its LoRARequest).
        lora = SimpleNamespace(lora_name=model) if model != "base" else None
        generators = [engine.generate(p, SimpleNamespace(n=2), f"r-{p}", lora_request=lora) for p in prompts]
        choices = []
        for p, outputs in enumerate(generators):
            async for out in outputs:
                choices += [{"index": p * 2 + o.index, "finish_reason": o.finish_reason} for o in out.outputs]
        return choices

    async def completions(request: Request) -> Any:
        body = await request.json()
        choices = await run(body["prompt"], body.get("model", "base"))
        if not body.get("stream"):
            return JSONResponse({"choices": choices})

        async def events() -> Any:
            for c in choices:
                yield f"data: {json.dumps({'choices': [{**c, 'finish_reason': None}]})}\n\n"
                yield f"data: {json.dumps({'choices': [c]})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    app.add_middleware(WeightVersionsMiddleware, pause_mode=PauseMode.ABORT, retry_after_s=2)
    return app


def test_each_choice_gets_the_spans_of_its_own_engine_request_and_the_header_all() -> None:
    engine = Engine()
    with TestClient(_app(engine)) as http:
        r = http.post("/v1/completions", json={"prompt": [7, 8]})
    assert r.status_code == 200
    versions = [c["weight_versions"] for c in r.json()["choices"]]
    assert versions == [
        [{"version": "3", "start": 0, "end": 4}],
        [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 4}],
        [{"version": "4", "start": 0, "end": 4}],
        [{"version": "4", "start": 0, "end": 4}],
    ]
    assert r.headers["x-weight-version"] == "3;3@0,4@2;4;4"
    assert int(r.headers["content-length"]) == len(r.content)
    assert len(engine.finished) == 4  # the refit history hears of every finished choice


def test_a_stream_carries_the_spans_on_the_chunk_that_ends_each_choice() -> None:
    with TestClient(_app(Engine())) as http:
        r = http.post("/v1/completions", json={"prompt": [7], "stream": True})
    chunks = [json.loads(e.removeprefix("data: ")) for e in r.text.split("\n\n") if e.startswith("data: {")]
    assert ["weight_versions" in c["choices"][0] for c in chunks] == [False, True, False, True]
    assert chunks[3]["choices"][0]["weight_versions"][1] == {"version": "4", "start": 2, "end": 4}
    assert r.text.endswith("data: [DONE]\n\n")


def test_an_aborted_request_is_a_retryable_503_saying_a_refit_ended_it() -> None:
    with TestClient(_app(Engine(finish_reason="abort"))) as http:
        r = http.post("/v1/completions", json={"prompt": [7]})
        stream = http.post("/v1/completions", json={"prompt": [7], "stream": True})
    assert r.status_code == 503 and r.headers["retry-after"] == "2"
    assert "aborted by a weight refit" in r.json()["error"]["message"]
    last = [e for e in stream.text.split("\n\n") if e.startswith("data: {")][-1]
    assert "aborted by a weight refit" in json.loads(last.removeprefix("data: "))["error"]["message"]


def test_the_label_is_one_version_or_each_with_its_first_token() -> None:
    assert label([Span("7", 0, 5)]) == "7"
    assert label([Span("7", 0, 5), Span("8", 5, 9)]) == "7@0,8@5"
    assert label([]) == ""


def test_choices_of_a_named_adapter_say_its_version_and_both_when_a_refit_committed_meanwhile() -> None:
    served = {"a": "3"}
    with TestClient(_app(Engine(), served)) as http:
        r = http.post("/v1/completions", json={"prompt": [7], "model": "a"})
        base = http.post("/v1/completions", json={"prompt": [7]})
    assert [c["adapter"] for c in r.json()["choices"]] == [{"name": "a", "version": "3"}] * 2
    assert r.headers["x-adapter-version"] == "a:3;a:3"
    assert "adapter" not in base.json()["choices"][0] and "x-adapter-version" not in base.headers

    versions = {"a": "3"}  # a refit of adapter a commits version 4 while the request runs
    with TestClient(_app(Engine(on_generate=lambda: versions.update(a="4")), versions)) as http:
        r = http.post("/v1/completions", json={"prompt": [8], "model": "a", "stream": True})
    ended = [json.loads(e.removeprefix("data: ")) for e in r.text.split("\n\n") if e.startswith("data: {")][
        -1
    ]
    assert ended["choices"][0]["adapter"] == {"name": "a", "version": "3,4"}
