"""The README's two snippets, run as written, against a syncd with `--auto-refit`: the trainer's
(transformers' Qwen3-MoE on one rank, `attach(model, ..., optimizer=..., wait_s=300)`) and the
receiver's (vLLM's `LLM(..., **ENGINE_ARGS)`, `attach`, a rollout loop of `wait_version(step)`).

Filled in as a reader fills them in: syncd's address and the model's path (`tests.readme_snippets`);
what they take from the program around them (`model`, `optimizer`, `data`, `steps`, `prompts`,
`sampling_params`) is passed in. The tiny model gets a word-level tokenizer, so the prompts are
text as a user's are; vLLM runs on CPU as its own CPU CI does (`VLLM_CPU_CI_ENV`: dynamo without
inductor); syncd's token reaches both sides through the environment, as in a deployment. The
trainer runs all its steps before the rollout loop starts, three versions ahead of it: every wait
of the loop finds a newer version served and returns it. The trainer's failing cases (a failed
install, no refit) run in the fast tier: tests/control/test_attach_waits.py.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from e2e_harness import Stack

from syncd.weight_version import Version
from tests.readme_snippets import (
    MODEL_PLACEHOLDER,
    RECEIVER_HEADING,
    SYNCD_PLACEHOLDER,
    filled,
    python_block,
    trainer_snippet,
)

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

STEPS = 3
VOCAB = 512  # the tiny model's


def add_word_tokenizer(model_dir: Path) -> None:
    """A tokenizer for the tiny model: words `w0` ... `w511`, one token each."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", eos_token="w1").save_pretrained(model_dir)


def training_batches(served_before: dict[int, Version], receiver: dict):
    """The trainer loop's `data`: STEPS batches; before batch k it notes what the receiver serves
    (after step k - 1 returned)."""
    gen = torch.Generator().manual_seed(0)
    for k in range(1, STEPS + 1):
        served_before[k] = receiver["handle"].version
        ids = torch.randint(2, VOCAB, (2, 16), generator=gen)
        yield {"input_ids": ids, "labels": ids}


def test_the_readme_snippets_run_as_written_with_a_trainer_ahead_of_its_rollouts(
    stack: Stack, model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import Qwen3MoeForCausalLM
    from vllm import SamplingParams

    add_word_tokenizer(model)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_CPU_CI_ENV", "1")
    stack.start_syncd(trainers=1, generators=1, auto_refit=True)
    monkeypatch.setenv("SYNCD_AUTH_TOKEN", stack.token)  # as a deployment hands both sides syncd's token
    receiver_code = filled(
        python_block(RECEIVER_HEADING), **{SYNCD_PLACEHOLDER: stack.target, MODEL_PLACEHOLDER: str(model)}
    )
    attaching, loop = receiver_code.split("for step in", 1)
    receiver = {
        "steps": STEPS,
        "prompts": ["w5 w9 w13", "w7 w2 w400 w31"],
        "sampling_params": SamplingParams(max_tokens=4, temperature=0),
    }
    exec(attaching, receiver)  # the LLM, attached as replica 0
    try:
        trained = Qwen3MoeForCausalLM.from_pretrained(model, dtype=torch.float32)
        served_before: dict[int, Version] = {}
        trainer = {
            "model": trained,
            "optimizer": torch.optim.SGD(trained.parameters(), lr=0.05),
            "data": training_batches(served_before, receiver),
        }
        exec(trainer_snippet(stack.target), trainer)
        # wait_s: each step returned only once the receiver served it
        assert served_before == {k: Version.of(k - 1) for k in range(1, STEPS + 1)}, served_before
        assert receiver["handle"].version == trainer["handle"].version == Version(str(STEPS), STEPS)

        exec("for step in" + loop, receiver)  # three versions behind: no wait times out
        assert receiver.pop("handle") is not None  # the loop's own close ran
        assert receiver["served"] == Version(str(STEPS), STEPS)
        assert len(receiver["rollouts"]) == len(receiver["prompts"])
        assert all(r.outputs[0].token_ids for r in receiver["rollouts"])
    finally:
        if "handle" in receiver:
            receiver.pop("handle").close()
        del receiver["llm"]
        gc.collect()
