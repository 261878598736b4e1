"""generator_svc.server.request_limits (what may reach the engine) and
generator_svc.server.admission (the bounded queue), without an engine: table-driven cases and a
property over random token ids."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from generator_svc.server.admission import Admission, OverloadedError
from generator_svc.server.request_limits import BadRequestError, RequestLimits, check_request

LIMITS = RequestLimits(vocab_size=256, max_model_len=64, max_logprobs=20, max_n=4, max_prompts=3)
COMPLETIONS, CHAT, GENERATE = "/v1/completions", "/v1/chat/completions", "/inference/v1/generate"

REFUSED = [
    # (path, body, words the message must hold: the field and the value)
    (COMPLETIONS, {"prompt": [1, 256]}, ["prompt[1]", "256", "[0, 256)"]),
    (COMPLETIONS, {"prompt": [-1]}, ["prompt[0]", "-1"]),
    (COMPLETIONS, {"prompt": [[1, 2], [3, 10**30]]}, ["prompt[1][1]", "outside the 64-bit"]),
    (COMPLETIONS, {"prompt": [[1, 2], [3, 2**40]]}, ["prompt[1][1]", str(2**40)]),
    (COMPLETIONS, {"prompt": [1, 2.0]}, ["prompt[1]", "integer", "2.0"]),
    (COMPLETIONS, {"prompt": [1, True]}, ["prompt[1]", "True"]),
    (COMPLETIONS, {"prompt": [1, "2"]}, ["prompt[1]", "'2'"]),
    (COMPLETIONS, {"prompt": [1, [2]]}, ["prompt[1]", "[2]"]),
    (COMPLETIONS, {"prompt": []}, ["prompt", "at least one token"]),
    (COMPLETIONS, {"prompt": [[1], []]}, ["prompt[1]", "at least one token"]),
    (COMPLETIONS, {"prompt": [[1]] * 4}, ["prompt", "4 prompts", "--max-prompts 3"]),
    (COMPLETIONS, {"prompt": ["a"] * 4}, ["prompt", "4 prompts"]),
    (COMPLETIONS, {"prompt": [1] * 64}, ["prompt", "64 tokens", "model length 64"]),
    (COMPLETIONS, {"prompt": [1] * 60, "max_tokens": 5}, ["max_tokens", "5", "[1, 4]", "60 tokens"]),
    (COMPLETIONS, {"prompt": [1], "max_tokens": 10**12}, ["max_tokens", str(10**12)]),
    (COMPLETIONS, {"prompt": [1], "max_tokens": 0}, ["max_tokens", "0"]),
    (COMPLETIONS, {"prompt": [1], "n": 5}, ["n", "5", "--max-n"]),
    (COMPLETIONS, {"prompt": [1], "n": 0}, ["n", "0"]),
    (COMPLETIONS, {"prompt": [1], "best_of": 1000}, ["best_of", "1000"]),
    (COMPLETIONS, {"prompt": [1], "logprobs": 21}, ["logprobs", "21", "--max-logprobs"]),
    (COMPLETIONS, {"prompt": [1], "prompt_logprobs": -2}, ["prompt_logprobs", "-2"]),
    (COMPLETIONS, {"prompt": [1], "top_k": 10**9}, ["top_k", str(10**9)]),
    (COMPLETIONS, {"prompt": [1], "temperature": float("nan")}, ["temperature", "nan"]),
    (COMPLETIONS, {"prompt": [1], "temperature": float("inf")}, ["temperature", "inf"]),
    (COMPLETIONS, {"prompt": [1], "logit_bias": {"300": 1.0}}, ["logit_bias['300']", "300"]),
    (COMPLETIONS, {"prompt": [1], "logit_bias": {"x": 1.0}}, ["logit_bias", "'x'"]),
    (COMPLETIONS, {"prompt": [1], "stop_token_ids": [1, -5]}, ["stop_token_ids[1]", "-5"]),
    (COMPLETIONS, {"prompt": [1], "allowed_token_ids": [999]}, ["allowed_token_ids[0]", "999"]),
    (COMPLETIONS, {"prompt": [1], "logprob_token_ids": ["3"]}, ["logprob_token_ids[0]", "'3'"]),
    (COMPLETIONS, {"prompt": [1], "stop_token_ids": 5}, ["stop_token_ids", "list"]),
    (CHAT, {"messages": [], "max_tokens": 64}, ["max_tokens", "64"]),
    (CHAT, {"messages": [], "max_completion_tokens": 10**20}, ["max_completion_tokens"]),
    (CHAT, {"messages": [], "top_logprobs": 50}, ["top_logprobs", "50"]),
    (CHAT, {"messages": [], "logit_bias": {"-1": 0}}, ["logit_bias['-1']", "-1"]),
    (CHAT, {"messages": [], "n": 10}, ["n", "10"]),
    ("/invocations", {"prompt": [1, 300]}, ["prompt[1]", "300"]),
    ("/invocations", {"messages": [], "max_tokens": 64}, ["max_tokens", "64"]),
    (GENERATE, {"token_ids": [1, 256], "sampling_params": {}}, ["token_ids[1]", "256"]),
    (GENERATE, {"token_ids": ["7"], "sampling_params": {}}, ["token_ids[0]", "'7'"]),
    (
        GENERATE,
        {"token_ids": [1] * 60, "sampling_params": {"max_tokens": 5}},
        ["sampling_params.max_tokens", "5"],
    ),
    (
        GENERATE,
        {"token_ids": [1], "sampling_params": {"logit_bias": {"999": 1}}},
        ["sampling_params.logit_bias"],
    ),
]


@pytest.mark.parametrize("path,body,words", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_a_request_that_must_not_reach_the_engine_is_refused_naming_field_and_value(path, body, words):
    with pytest.raises(BadRequestError) as raised:
        check_request(path, body, LIMITS)
    for word in words:
        assert word in str(raised.value), (word, str(raised.value))


ACCEPTED = [
    (COMPLETIONS, {"prompt": [0, 255], "max_tokens": 62, "n": 4, "logprobs": 20}),
    (COMPLETIONS, {"prompt": [[1], [2, 3], [255] * 63], "max_tokens": 1}),
    (COMPLETIONS, {"prompt": "text is tokenized and checked by vLLM", "max_tokens": 63}),
    (COMPLETIONS, {"prompt": [1], "logit_bias": {"0": -100, "255": 100}, "stop_token_ids": [255]}),
    (COMPLETIONS, {"prompt": [1], "max_tokens": None, "logprobs": None, "top_k": -1}),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 63, "top_logprobs": 20}),
    (GENERATE, {"token_ids": [1, 255], "sampling_params": {"max_tokens": 62, "n": 4}}),
    ("/v1/models", {"prompt": [10**6]}),  # not a generation route
    (COMPLETIONS, ["not", "an", "object"]),  # vLLM's request model refuses it
]


@pytest.mark.parametrize("path,body", ACCEPTED)
def test_a_request_within_the_limits_passes(path, body):
    check_request(path, body, LIMITS)


@given(st.lists(st.integers(min_value=-(2**70), max_value=2**70), min_size=1, max_size=8))
def test_a_prompt_passes_exactly_when_every_id_is_in_the_vocabulary(prompt):
    inside = all(0 <= t < LIMITS.vocab_size for t in prompt)
    try:
        check_request(COMPLETIONS, {"prompt": prompt, "max_tokens": 4}, LIMITS)
    except BadRequestError as e:
        assert not inside
        named = [i for i, t in enumerate(prompt) if f"prompt[{i}]:" in str(e)]
        assert named and not 0 <= prompt[named[0]] < LIMITS.vocab_size, str(e)
    else:
        assert inside


def test_deeply_nested_json_is_refused_not_a_crash():
    body: object = 1
    for _ in range(100_000):
        body = [body]
    with pytest.raises(BadRequestError, match="nested too deeply"):
        check_request(COMPLETIONS, {"prompt": [1], "extra": body}, LIMITS)


def test_admission_queues_to_its_bound_then_refuses():
    async def scenario() -> list[str]:
        admission = Admission(max_concurrent=2, max_queued=1)
        release = asyncio.Event()
        events: list[str] = []

        async def request(name: str) -> None:
            try:
                async with admission.slot():
                    events.append(f"{name} runs")
                    await release.wait()
            except OverloadedError as e:
                events.append(f"{name} refused: {e}")

        tasks = [asyncio.create_task(request(n)) for n in ("a", "b", "c")]
        await asyncio.sleep(0)  # a and b run, c waits
        await request("d")  # two running, one queued: refused at once
        assert (admission.running, admission.waiting) == (2, 1)
        release.set()
        await asyncio.gather(*tasks)
        assert (admission.running, admission.waiting) == (0, 0)
        return events

    events = asyncio.run(scenario())
    assert events[:3] == ["a runs", "b runs", events[2]] and events[2].startswith(
        "d refused: 2 requests running"
    )
    assert "--max-queued-requests 1" in events[2] and events[3] == "c runs"
