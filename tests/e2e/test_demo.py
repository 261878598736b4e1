"""`make demo`, the main job, as a user runs it: every refit commits, every byte checks, the
generator's policy matches the trainer's after each refit, and bfloat16 moves 2 bytes per weight."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
from pathlib import Path

import pytest
from e2e_harness import References
from safetensors import safe_open

from deploy.local.processes import PYTHON, REPO
from generator_svc.settings import EngineStart
from trainer_svc.tiny import TINY_ARGS, make_tiny_checkpoint

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]


def _run_demo(tmp_path, *args: str) -> dict:
    summary_path, work = tmp_path / "summary.json", tmp_path / "demo"
    run = subprocess.run(
        [
            PYTHON,
            "-m",
            "deploy.local.demo",
            "--workdir",
            str(work),
            "--summary-json",
            str(summary_path),
            *args,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:] + _logged_errors(work / "logs")
    return json.loads(summary_path.read_text())


def _logged_errors(logs: Path, most: int = 40) -> str:
    """The services' error lines, which the demo's own output does not carry (CI keeps no files)."""
    lines = [
        f"{log.name}: {line}"
        for log in sorted(logs.glob("*.log"))
        for line in log.read_text(errors="replace").splitlines()
        if "ERROR" in line or "Exception" in line or "Traceback" in line
    ]
    shown = f"the first {most} of {len(lines)}" if len(lines) > most else "all"
    return f"\n{shown} error lines the services logged (shutdown's come last):\n" + "\n".join(lines[:most])


def test_the_demo_refits_a_bfloat16_generator_after_every_step_while_clients_generate(tmp_path):
    """`make demo` with two clients generating through its refits (`--pause-mode keep`): every
    refit commits, none of the clients' requests fails, every answer says which weight versions
    produced its tokens, and each refit's pause is recorded."""
    summary = _run_demo(tmp_path, "--steps", "2", "--pause-mode", "keep", "--load", "2", "--max-tokens", "64")
    work = tmp_path / "demo"
    assert summary["refits"] == summary["refits_committed"] == 2 and summary["checksums_ok"], summary
    # After a refit the generator (bfloat16 arithmetic) samples as the trainer scores its bfloat16
    # export (float32 arithmetic): equal weights, so only the arithmetic differs; before, the
    # policies are a training step apart.
    assert summary["kl_after_max"] < 1e-4 < summary["kl_before_first"], summary
    with safe_open(str(work / "export" / "step-1" / "model.safetensors"), framework="pt") as f:
        elements = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 - safe_open is not iterable
    assert [p["bytes"] for p in summary["refit_phases"]] == [2 * elements] * 2, summary["refit_phases"]
    assert summary["load_requests"] > 0 and summary["failed_requests"] == 0, summary
    assert summary["responses_without_versions"] == 0, summary
    assert [p["step"] for p in summary["refit_pauses"]] == [1, 2], summary["refit_pauses"]
    assert all(p["install_s"] > 0 and p["pause_s"] > 0 for p in summary["refit_pauses"]), summary


def test_the_lora_demo_refits_only_target_modules_bit_exact_with_vllm_on_the_merge(tmp_path):
    """`--lora-rank 8` on a `--model-dir` whose vocabulary (256) is smaller than the demo's old
    fixed prompts (ids up to 400 once killed the generator's engine on the first completion; the
    prompts now come from the model's vocabulary). Every refit moves the target modules' merged
    weights and nothing else, and after each one the generator's greedy tokens and logprobs equal,
    bit for bit, vLLM's on the base checkpoint merged with that step's adapter (reassembled from
    the trainer's shards and merged whole, as `trainer_svc.lora.merge` defines it). vLLM's: a
    reference engine started on the first merge as vLLM starts one (spawn; the generator's forks)
    and loading the later ones through vLLM's own loaders (tests/generator holds such a load equal
    to a fresh engine, token for token)."""
    import torch

    from trainer_svc.hf_checkpoint import load_hf, save_hf
    from trainer_svc.lora.checkpoint import load_adapter, merge_checkpoint

    model = make_tiny_checkpoint(
        tmp_path / "model", seed=3, args=dataclasses.replace(TINY_ARGS, vocab_size=256)
    )
    summary = _run_demo(tmp_path, "--lora-rank", "8", "--steps", "3", "--model-dir", str(model))
    work = tmp_path / "demo"
    assert summary["refits"] == summary["refits_committed"] == 3 and summary["checksums_ok"], summary
    lora = summary["lora"]
    assert lora["target_tensors"] == 7 * TINY_ARGS.num_hidden_layers, lora  # q, k, v, o, gate, up, down
    assert [p["bytes"] for p in summary["refit_phases"]] == [lora["target_bytes"]] * 3, summary
    assert lora["target_bytes"] < lora["model_bytes"], lora

    args, base = load_hf(model)
    (tmp_path / "references").mkdir()
    # This test's own (no other test serves its vocabulary), started as vLLM starts engines.
    references = References(tmp_path / "references", EngineStart.SPAWN)
    try:
        for row in summary["steps"]:
            step = row["step"]
            adapter = load_adapter(work / "export" / f"step-{step}")
            merge = merge_checkpoint(base, adapter, torch.bfloat16)
            merged = save_hf(tmp_path / f"reference-{step}", args, merge, "bfloat16")
            engine = references.serving(merged)
            expected = _greedy(str(engine.http.base_url), _prompts(model))
            assert [(t, lp) for t, lp in row["greedy"]] == expected, f"step {step}"
    finally:
        references.stop()


def _prompts(model: Path) -> list[list[int]]:
    from deploy.local.demo import vocabulary_prompts

    return vocabulary_prompts(model, seed=0)


def _greedy(url: str, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    from deploy.local import openai_client

    api = openai_client.client(url)
    return [openai_client.complete(api, "tiny", p, max_tokens=8, temperature=0) for p in prompts]
