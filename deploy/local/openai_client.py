"""Talking to the generator as users do: the `openai` client against its OpenAI-compatible
server, completions of token-id prompts with the sampled tokens' logprobs."""

from __future__ import annotations

import openai

from syncd.http_client import tls_context


def client(url: str, timeout_s: float = 120) -> openai.OpenAI:
    """A client of the generator at `url` (no /v1). It needs no key; no retries, so a failing
    request fails the caller instead of being repeated. Its HTTP client takes the process's TLS
    context (`syncd.http_client`): clients are made per check, and a context costs ~40 ms each."""
    return openai.OpenAI(
        base_url=f"{url.rstrip('/')}/v1",
        api_key="unused",
        timeout=timeout_s,
        max_retries=0,
        http_client=openai.DefaultHttpxClient(verify=tls_context()),
    )


def complete(api: openai.OpenAI, model: str, prompt: list[int], **sampling) -> tuple[list[int], list[float]]:
    """One completion of a token-id prompt: the sampled token ids and their logprobs.
    `sampling`: max_tokens, temperature, seed, ... as `completions.create` takes them."""
    r = api.completions.create(
        model=model,
        prompt=prompt,
        logprobs=1,
        **sampling,
        # vLLM's extensions: no tokenizer here, so tokens come back as "token_id:N".
        extra_body={"detokenize": False, "return_tokens_as_token_ids": True},
    )
    lp = r.choices[0].logprobs
    return [int(t.removeprefix("token_id:")) for t in lp.tokens], list(lp.token_logprobs)
