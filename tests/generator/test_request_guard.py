"""One bad request must not kill a generator: against the shared live generator (real vLLM on CPU,
`--skip-tokenizer-init` as the demo runs it), requests carrying out-of-vocabulary, negative and
huge token ids, over-long prompts and absurd sizes are answered 400 naming the problem, and after
each the generator is healthy and its greedy tokens are the ones it gave before."""

from __future__ import annotations

import json

import pytest

from tests.generator.conftest import PROMPTS, Service
from tests.keep_alive import answers_after_idling
from trainer_svc.tiny import TINY_ARGS

pytestmark = pytest.mark.vllm
VOCAB = TINY_ARGS.vocab_size  # 512; the generator reads it from the engine's model config
MAX_MODEL_LEN = 256  # the fixture's --max-model-len

COMPLETION = {"model": "tiny", "max_tokens": 4, "temperature": 0}
BAD = [
    # (body, words the error message must hold: the field and the value)
    ({"prompt": [1, 2, VOCAB]}, ["prompt[2]", str(VOCAB), f"[0, {VOCAB})"]),
    ({"prompt": [100000]}, ["prompt[0]", "100000"]),
    ({"prompt": [3, -1]}, ["prompt[1]", "-1"]),
    ({"prompt": [2**31]}, ["prompt[0]", str(2**31)]),
    ({"prompt": [2**63 - 1]}, ["prompt[0]", str(2**63 - 1)]),
    ({"prompt": [10**40]}, ["prompt[0]", "64-bit"]),
    ({"prompt": [[1, 2], [3, 4096]]}, ["prompt[1][1]", "4096"]),
    ({"prompt": [1, 2.5]}, ["prompt[1]", "2.5"]),
    ({"prompt": []}, ["prompt", "at least one token"]),
    ({"prompt": [7] * MAX_MODEL_LEN}, ["prompt", f"{MAX_MODEL_LEN} tokens", f"model length {MAX_MODEL_LEN}"]),
    ({"prompt": [7] * 250, "max_tokens": 10}, ["max_tokens", "10", "250 tokens"]),
    ({"prompt": [1], "max_tokens": 10**12}, ["max_tokens", str(10**12)]),
    ({"prompt": [1], "max_tokens": 2**63}, ["max_tokens", "64-bit"]),
    ({"prompt": [1], "n": 10**6}, ["n", str(10**6), "--max-n"]),
    ({"prompt": [1], "best_of": 10**6}, ["best_of", str(10**6)]),
    ({"prompt": [1], "logprobs": 10**6}, ["logprobs", str(10**6)]),
    ({"prompt": [1], "prompt_logprobs": 10**6}, ["prompt_logprobs", str(10**6)]),
    ({"prompt": [1], "top_k": 2**40}, ["top_k", str(2**40)]),
    ({"prompt": [1], "logit_bias": {str(VOCAB + 7): 5}}, [f"logit_bias['{VOCAB + 7}']"]),
    ({"prompt": [1], "allowed_token_ids": [1, 10**9]}, ["allowed_token_ids[1]", str(10**9)]),
    ({"prompt": [1], "stop_token_ids": [-3]}, ["stop_token_ids[0]", "-3"]),
    ({"prompt": [1], "logprob_token_ids": [VOCAB], "logprobs": 1}, ["logprob_token_ids[0]"]),
    ({"prompt": [[1]] * 65}, ["prompt", "65 prompts", "--max-prompts 64"]),
]


@pytest.fixture(scope="module")
def greedy_before(service_a: Service, outputs_a: dict) -> tuple[list[int], list[float]]:
    return outputs_a["short"]


def _assert_alive_and_unchanged(service: Service, greedy_before) -> None:
    assert service.http.get("/healthz").status_code == 200, service.log_tail()
    assert service.complete(PROMPTS["short"]) == greedy_before


@pytest.mark.parametrize("body,words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_a_bad_completion_is_a_400_naming_it_and_the_generator_lives_on(
    service_a: Service, greedy_before, body, words
):
    r = service_a.http.post("/v1/completions", json={**COMPLETION, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == 400 and all(w in error["message"] for w in words), (words, error)
    _assert_alive_and_unchanged(service_a, greedy_before)


@pytest.mark.parametrize(
    "body,words",
    [
        ({"logit_bias": {"-4": 1}}, ["logit_bias['-4']"]),
        ({"allowed_token_ids": [VOCAB]}, ["allowed_token_ids[0]"]),
        ({"max_tokens": 10**9}, ["max_tokens", str(10**9)]),
        ({"n": 1000}, ["n", "1000"]),
        ({"top_logprobs": 999, "logprobs": True}, ["top_logprobs", "999"]),
    ],
)
def test_a_bad_chat_completion_is_a_400_naming_it(service_a: Service, greedy_before, body, words):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **body}
    r = service_a.http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400 and all(w in r.json()["error"]["message"] for w in words), r.text
    _assert_alive_and_unchanged(service_a, greedy_before)


def test_a_nan_temperature_is_a_400(service_a: Service, greedy_before):
    # httpx refuses to send NaN as JSON; Python's json writes it as the literal clients may send.
    body = json.dumps({**COMPLETION, "prompt": [1, 2], "temperature": float("nan")})
    r = service_a.http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"], r.text
    _assert_alive_and_unchanged(service_a, greedy_before)


def test_a_body_over_the_size_limit_is_a_413(service_a: Service, greedy_before):
    body = {**COMPLETION, "prompt": [1], "user": "x" * (5 << 20)}  # the default limit is 4 MiB
    r = service_a.http.post("/v1/completions", json=body)
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"], r.text
    _assert_alive_and_unchanged(service_a, greedy_before)


def test_refusals_are_counted(service_a: Service):
    service_a.http.post("/v1/completions", json={**COMPLETION, "prompt": [VOCAB]})
    metrics = service_a.http.get("/metrics").text
    line = next(
        x
        for x in metrics.splitlines()
        if x.startswith('weightsync_generator_rejected_requests_total{reason="invalid"}')
    )
    assert float(line.split()[-1]) >= 1
    assert "weightsync_generator_engine_alive 1.0" in metrics


def test_sagemakers_invocations_route_is_guarded_too(service_a: Service, greedy_before):
    r = service_a.http.post("/invocations", json={**COMPLETION, "prompt": [1, 100000]})
    assert r.status_code == 400 and "prompt[1]" in r.json()["error"]["message"], r.text
    _assert_alive_and_unchanged(service_a, greedy_before)


def test_chat_without_a_tokenizer_is_a_400_that_says_where_to_go(service_a: Service):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = service_a.http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400 and "/v1/completions" in r.json()["error"]["message"], r.text


def test_the_token_in_token_out_route_is_guarded_too(service_a: Service, greedy_before):
    body = {"model": "tiny", "token_ids": [1, VOCAB], "sampling_params": {"max_tokens": 4}}
    r = service_a.http.post("/inference/v1/generate", json=body)
    assert r.status_code == 400 and "token_ids[1]" in r.json()["error"]["message"], r.text
    body = {"model": "tiny", "token_ids": [1, 2], "sampling_params": {"max_tokens": 10**12}}
    r = service_a.http.post("/inference/v1/generate", json=body)
    assert r.status_code == 400 and "sampling_params.max_tokens" in r.json()["error"]["message"], r.text
    _assert_alive_and_unchanged(service_a, greedy_before)


def test_an_idle_connection_outlives_the_clients_pools(service_a: Service):
    """A rollout client reusing its pooled connection after 5 s idle (openai, httpx) is answered:
    vLLM's keep-alive, uvicorn's 5 s, once closed one as a demo client's request went out on it."""
    assert answers_after_idling(service_a.url, "/v1/weight_version") == [200, 200]
