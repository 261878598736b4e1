"""Property-based fuzzing of the completions routes of a live generator (real vLLM on CPU, no
tokenizer): hypothesis builds request bodies whose token ids are drawn with the vocabulary in mind
(inside, at its edges, negative, beyond int64) together with absurd sizes and non-finite floats.

Properties, per request: never a server error; a request `check_request` refuses is a 400 with
exactly its message (the engine never saw it); the generator stays healthy. After the run its
greedy tokens and logprobs are those it gave before. Bounded: a fixed number of examples, each
generating at most a few tokens (a run takes seconds to tens of seconds)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from generator_svc.server.request_limits import BadRequestError, RequestLimits, check_request
from generator_svc.settings import Settings
from tests.generator.conftest import PROMPTS, Service
from trainer_svc.tiny import TINY_ARGS

pytestmark = pytest.mark.vllm
EXAMPLES = 60
# The live generator's bounds: the engine's vocabulary, the fixture's --max-model-len, vLLM's
# default --max-logprobs and generator_svc's default settings.
LIMITS = RequestLimits(
    vocab_size=TINY_ARGS.vocab_size,
    max_model_len=256,
    max_logprobs=20,
    max_n=Settings.max_n,
    max_prompts=Settings.max_prompts,
)
V = LIMITS.vocab_size

token_ids = st.one_of(
    st.integers(0, V - 1),
    st.integers(0, V - 1),  # twice: most ids are valid, so most prompts get past the first id
    st.sampled_from([-1, V, V + 1, 2**31, 2**32, 2**63 - 1, -(2**63), 2**63, 10**30]),
    st.integers(-(2**70), 2**70),
)
prompts = st.one_of(
    st.lists(token_ids, min_size=0, max_size=12),
    st.lists(st.integers(0, V - 1), min_size=240, max_size=260),  # at and past the model length
    st.lists(st.lists(token_ids, min_size=1, max_size=6), min_size=1, max_size=3),
    st.lists(
        st.one_of(st.integers(0, V - 1), st.floats(allow_nan=True), st.booleans()), min_size=1, max_size=4
    ),
)
sizes = st.one_of(st.integers(1, 3), st.sampled_from([0, -1, 255, 256, 2**31, 2**63 - 1, 2**63, 10**20]))
floats = st.one_of(st.floats(0, 2), st.floats(allow_nan=True, allow_infinity=True))
optional = {
    "max_tokens": sizes,
    "min_tokens": sizes,
    "n": st.one_of(st.integers(1, 2), st.sampled_from([0, 17, 10**6])),
    "best_of": st.sampled_from([1, 2, 10**6]),
    "logprobs": st.one_of(st.integers(0, 3), st.sampled_from([-1, 21, 10**6])),
    "prompt_logprobs": st.one_of(st.integers(0, 2), st.sampled_from([21, 10**9])),
    "echo": st.booleans(),
    "temperature": floats,
    "top_p": floats,
    "top_k": st.one_of(st.integers(-1, 8), st.sampled_from([V, V + 1, 2**40])),
    "seed": st.integers(-(2**64), 2**64),
    "logit_bias": st.dictionaries(token_ids.map(str), floats, max_size=3),
    "stop_token_ids": st.lists(token_ids, max_size=3),
    "allowed_token_ids": st.lists(token_ids, min_size=1, max_size=3),
    "logprob_token_ids": st.lists(token_ids, min_size=1, max_size=2),
    "stream": st.booleans(),
}
completions = st.fixed_dictionaries({"model": st.just("tiny"), "prompt": prompts}, optional=optional)
chat_optional = {
    k: optional[k] for k in ("max_tokens", "n", "temperature", "logit_bias", "allowed_token_ids")
}
chats = st.fixed_dictionaries(
    {"model": st.just("tiny"), "messages": st.just([{"role": "user", "content": "hi"}])},
    optional={**chat_optional, "top_logprobs": optional["logprobs"], "max_completion_tokens": sizes},
)
requests = st.one_of(
    st.tuples(st.just("/v1/completions"), completions),
    st.tuples(st.just("/v1/completions"), completions),
    st.tuples(st.just("/v1/chat/completions"), chats),
)


def _expected_refusal(path: str, body: dict) -> str | None:
    try:
        check_request(path, body, LIMITS)
    except BadRequestError as e:
        return str(e)
    return None


def test_fuzzed_completions_never_reach_the_engine_broken(service_a: Service, outputs_a: dict):
    greedy_before = outputs_a["short"]
    seen: dict[int, int] = {}

    # Both sides of the edge every run, whatever the draw: one CI run drew 60 refusals and no answer.
    @example(("/v1/completions", {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}))
    @example(("/v1/completions", {"model": "tiny", "prompt": [-1], "max_tokens": 2}))
    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(requests)
    def one_request(request: tuple[str, dict]) -> None:
        path, body = request
        # Python's json writes NaN and Infinity as the literals some clients send.
        r = service_a.http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (path, body, r.status_code, r.text[:500])
        refusal = _expected_refusal(path, body)
        if refusal is not None:
            assert r.status_code == 400 and r.json()["error"]["message"] == refusal, (body, r.text[:500])
        assert service_a.http.get("/healthz").status_code == 200, (body, service_a.log_tail())

    one_request()
    assert seen.get(200, 0) > 0 and seen.get(400, 0) > 0, seen  # both sides of the edge were reached
    assert service_a.complete(PROMPTS["short"]) == greedy_before
    assert service_a.complete(PROMPTS["long"]) == outputs_a["long"]
