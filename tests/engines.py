"""How the tests start vLLM engines on CPU: the tiny models' flags, one definition for every
harness (tests/generator/conftest.py, tests/e2e/e2e_harness.py).

The KV cache is sized for the tiny models (64 MiB: 65,536 tokens of 256-token requests), not with
`VLLM_CPU_KVCACHE_SPACE=1`: vLLM on CPU makes its KV cache resident, so 1 GiB made every engine's
worker ~1.6 GB instead of ~0.7 GB, and the tests that run several engines at once (a lab of three
replicas, an attached LLM beside fresh `vllm serve`s) ran the machine out of memory on 24 GiB
when test files ran side by side. `VLLM_CPU_KVCACHE_SPACE`, where set, overrides the flag: the
harnesses do not set it.
"""

from __future__ import annotations

KV_CACHE_BYTES = 64 << 20
ENGINE_FLAGS = [
    "--served-model-name",
    "tiny",
    "--enforce-eager",
    "--max-model-len",
    "256",
    "--skip-tokenizer-init",
    "--kv-cache-memory-bytes",
    str(KV_CACHE_BYTES),
]
