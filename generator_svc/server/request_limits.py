"""What a generation request may carry into the engine, checked at the API edge before vLLM sees it.

The generator runs vLLM with `--skip-tokenizer-init` (prompts are token ids), so vLLM checks no
prompt token id: one id outside `[0, vocab)` fails the embedding lookup inside the engine core and
kills the engine (seen with vLLM CPU on 2026-11-25). Numbers the engine turns into
tensors or loop bounds (max_tokens, n, top_k) and non-finite floats (a NaN temperature reaches the
sampler) are as dangerous. So every token id a request carries is an integer in `[0, vocab)`, the
prompt plus `max_tokens` fits the model length, counts are bounded by the generator's settings and
every number is finite and within int64; anything else is a `BadRequestError` naming the field and the
value, answered 400 by `generator_svc.server.request_guard`.

Pure: `check_request(path, body, limits)` raises `BadRequestError` or returns; no I/O, no vLLM import.
What is not checked here (types of other fields, option combinations) vLLM's own request models
and `SamplingParams` validate in the API process, before the engine.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Fields holding lists of token ids, on both the completions and the chat route.
TOKEN_ID_LISTS = ("stop_token_ids", "allowed_token_ids", "logprob_token_ids", "bad_words_token_ids")
_INTEGER_KEY = re.compile(r"-?[0-9]+")


@dataclass(frozen=True)
class RequestLimits:
    """The bounds one generator enforces: the engine's model (vocabulary, model length, vLLM's
    `--max-logprobs`) and generator_svc's settings (counts)."""

    vocab_size: int
    max_model_len: int
    max_logprobs: int  # vLLM's --max-logprobs; -1 there means the whole vocabulary
    max_n: int
    max_prompts: int

    @property
    def logprobs_bound(self) -> int:
        return self.vocab_size if self.max_logprobs < 0 else self.max_logprobs


class BadRequestError(ValueError):
    """A request the engine must not see; the message names the field and the value."""


def _show(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_finite(value: Any, where: str) -> None:
    """Every number in the body is finite and within int64, wherever it is."""
    if isinstance(value, float) and not math.isfinite(value):
        raise BadRequestError(f"{where}: {value} is not a finite number")
    if isinstance(value, int) and not isinstance(value, bool) and not INT64_MIN <= value <= INT64_MAX:
        raise BadRequestError(f"{where}: {_show(value)} is outside the 64-bit integer range")
    if isinstance(value, dict):
        for key, item in value.items():
            _check_finite(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_finite(item, f"{where}[{i}]")


def _check_token_id(value: Any, where: str, limits: RequestLimits) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequestError(f"{where}: token id must be an integer, got {_show(value)}")
    if not 0 <= value < limits.vocab_size:
        raise BadRequestError(
            f"{where}: token id {_show(value)} is outside the vocabulary [0, {limits.vocab_size})"
        )


def _check_int(body: dict, name: str, low: int, high: int, why: str = "") -> None:
    """`body[name]`, when present and not null, is an integer in [low, high]."""
    value = body.get(name)
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequestError(f"{name}: must be an integer, got {_show(value)}")
    if not low <= value <= high:
        raise BadRequestError(f"{name}: {_show(value)} is outside [{low}, {high}]{why}")


def _check_token_fields(body: dict, limits: RequestLimits) -> None:
    """The token ids a request carries besides its prompt: id lists and logit_bias keys."""
    for name in TOKEN_ID_LISTS:
        ids = body.get(name)
        if ids is None:
            continue
        if not isinstance(ids, list):
            raise BadRequestError(f"{name}: must be a list of token ids, got {_show(ids)}")
        if len(ids) > limits.vocab_size:
            raise BadRequestError(
                f"{name}: {len(ids)} token ids, more than the vocabulary of {limits.vocab_size}"
            )
        for i, token in enumerate(ids):
            _check_token_id(token, f"{name}[{i}]", limits)
    bias = body.get("logit_bias")
    if isinstance(bias, dict):
        for key in bias:
            if not isinstance(key, str) or not _INTEGER_KEY.fullmatch(key):
                raise BadRequestError(f"logit_bias: key {_show(key)} is not a token id")
            _check_token_id(int(key), f"logit_bias[{key!r}]", limits)


def _check_sampling(body: dict, limits: RequestLimits) -> None:
    _check_int(body, "n", 1, limits.max_n, " (the generator's --max-n)")
    _check_int(body, "best_of", 1, limits.max_n, " (the generator's --max-n)")
    _check_int(body, "prompt_logprobs", 0, limits.logprobs_bound, " (vLLM's --max-logprobs)")
    _check_int(body, "top_k", -1, limits.vocab_size, " (the vocabulary)")
    _check_token_fields(body, limits)


def _prompt_lengths(prompt: Any, limits: RequestLimits) -> list[int]:
    """Token counts of the token-id prompts of a completions request (text prompts are tokenized
    by vLLM, which checks their length and ids itself); raises BadRequestError for a bad id."""
    if not isinstance(prompt, list):
        return []
    if prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) > limits.max_prompts:
            raise BadRequestError(
                f"prompt: {len(prompt)} prompts, more than --max-prompts {limits.max_prompts}"
            )
        return []
    if prompt and all(isinstance(p, list) for p in prompt):
        if len(prompt) > limits.max_prompts:
            raise BadRequestError(
                f"prompt: {len(prompt)} prompts, more than --max-prompts {limits.max_prompts}"
            )
        prompts, names = prompt, [f"prompt[{i}]" for i in range(len(prompt))]
    else:
        prompts, names = [prompt], ["prompt"]
    return [_check_prompt(tokens, name, limits) for tokens, name in zip(prompts, names)]


def _check_prompt(tokens: list, name: str, limits: RequestLimits) -> int:
    """One token-id prompt: not empty, room to generate, every id in the vocabulary; its length."""
    if not tokens:
        raise BadRequestError(f"{name}: a prompt needs at least one token")
    if len(tokens) >= limits.max_model_len:
        raise BadRequestError(
            f"{name}: {len(tokens)} tokens leave no room to generate within the model length "
            f"{limits.max_model_len}"
        )
    for i, token in enumerate(tokens):
        _check_token_id(token, f"{name}[{i}]", limits)
    return len(tokens)


def _check_generation(body: dict, prompt_tokens: int, limits: RequestLimits) -> None:
    """The sampling fields of a request whose longest prompt has `prompt_tokens` tokens."""
    room, why = limits.max_model_len - prompt_tokens, _room(prompt_tokens, limits.max_model_len)
    _check_int(body, "logprobs", 0, limits.logprobs_bound, " (vLLM's --max-logprobs)")
    _check_int(body, "max_tokens", 1, room, why)
    _check_int(body, "min_tokens", 0, room, why)
    _check_sampling(body, limits)


def check_completion(body: dict, limits: RequestLimits) -> None:
    """`POST /v1/completions`."""
    _check_generation(body, max(_prompt_lengths(body.get("prompt"), limits), default=0), limits)


def check_generate(body: dict, limits: RequestLimits) -> None:
    """`POST /inference/v1/generate` (vLLM's token-in, token-out route): `token_ids` and the
    `sampling_params` object (whose field names the message prefixes)."""
    tokens = body.get("token_ids")
    prompt_tokens = _check_prompt(tokens, "token_ids", limits) if isinstance(tokens, list) else 0
    params = body.get("sampling_params")
    if isinstance(params, dict):
        try:
            _check_generation(params, prompt_tokens, limits)
        except BadRequestError as e:
            raise BadRequestError(f"sampling_params.{e}") from None


def check_chat(body: dict, limits: RequestLimits) -> None:
    """`POST /v1/chat/completions` (the chat template's tokens count too: vLLM checks the total)."""
    for name in ("max_tokens", "max_completion_tokens", "min_tokens"):
        _check_int(
            body, name, 1 if name != "min_tokens" else 0, limits.max_model_len - 1, " (the model length - 1)"
        )
    _check_int(body, "top_logprobs", 0, limits.logprobs_bound, " (vLLM's --max-logprobs)")
    _check_sampling(body, limits)


def _room(prompt_tokens: int, max_model_len: int) -> str:
    return f" (the model length {max_model_len} minus the prompt's {prompt_tokens} tokens)"


def check_invocation(body: dict, limits: RequestLimits) -> None:
    """`POST /invocations` (SageMaker's route): vLLM serves it as a chat or a completions request,
    whichever request model the body fits."""
    (check_chat if "messages" in body else check_completion)(body, limits)


CHECKS: dict[str, Callable[[dict, RequestLimits], None]] = {
    "/v1/completions": check_completion,
    "/v1/chat/completions": check_chat,
    "/invocations": check_invocation,
    "/inference/v1/generate": check_generate,
}


def check_request(path: str, body: Any, limits: RequestLimits) -> None:
    """Raise BadRequestError if `body` (the parsed JSON of a POST to `path`) must not reach the engine.
    A body that is not a JSON object is left to vLLM's request model, which refuses it."""
    check = CHECKS.get(path)
    if check is None or not isinstance(body, dict):
        return
    try:
        _check_finite(body, "")
    except RecursionError:
        raise BadRequestError("request body: JSON nested too deeply") from None
    check(body, limits)
