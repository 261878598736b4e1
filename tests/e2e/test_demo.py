"""`make demo`, the main job, as a user runs it: every refit commits, every byte checks, the
generator's policy matches the trainer's after each refit, and bfloat16 moves 2 bytes per weight."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
from pathlib import Path

import pytest
from safetensors import safe_open

from deploy.local.processes import PYTHON, REPO
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


def test_the_demo_refits_a_bfloat16_generator_after_every_step(tmp_path):
    summary = _run_demo(tmp_path, "--steps", "2")
    work = tmp_path / "demo"
    assert summary["refits"] == summary["refits_committed"] == 2 and summary["checksums_ok"], summary
    # After a refit the generator (bfloat16 arithmetic) samples as the trainer scores its bfloat16
    # export (float32 arithmetic): equal weights, so only the arithmetic differs; before, the
    # policies are a training step apart.
    assert summary["kl_after_max"] < 1e-4 < summary["kl_before_first"], summary
    with safe_open(str(work / "export" / "step-1" / "model.safetensors"), framework="pt") as f:
        elements = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 - safe_open is not iterable
    assert [p["bytes"] for p in summary["refit_phases"]] == [2 * elements] * 2, summary["refit_phases"]


def test_the_demo_serves_a_model_dir_whose_vocabulary_is_smaller_than_its_old_fixed_prompts(tmp_path):
    """`--model-dir` on a Qwen3-MoE of vocabulary 256: the prompts come from the model's vocabulary
    (fixed ids up to 400 once killed the generator's engine on the first completion). The same run
    keeps two clients generating through its refits with `--pause-mode keep`: none fails, every
    answer says which weight versions produced its tokens, and each refit's pause is recorded."""
    model = make_tiny_checkpoint(
        tmp_path / "model", seed=3, args=dataclasses.replace(TINY_ARGS, vocab_size=256)
    )
    summary = _run_demo(
        tmp_path, "--steps", "2", "--model-dir", str(model),
        "--pause-mode", "keep", "--load", "2", "--max-tokens", "64",
    )  # fmt: skip
    assert summary["refits"] == summary["refits_committed"] == 2 and summary["checksums_ok"], summary
    assert summary["kl_after_max"] < 1e-4, summary
    assert summary["load_requests"] > 0 and summary["failed_requests"] == 0, summary
    assert summary["responses_without_versions"] == 0, summary
    assert [p["step"] for p in summary["refit_pauses"]] == [1, 2], summary["refit_pauses"]
    assert all(p["install_s"] > 0 and p["pause_s"] > 0 for p in summary["refit_pauses"]), summary


def test_the_lora_demo_refits_only_target_modules_bit_exact_with_a_fresh_engine_on_the_merge(tmp_path):
    """`--lora-rank 8`: every refit moves the target modules' merged weights and nothing else, and
    after each one the generator's greedy tokens and logprobs equal, bit for bit, a fresh vLLM's on
    the base checkpoint merged with that step's adapter (reassembled from the trainer's shards and
    merged whole, as `trainer_svc.lora.merge` defines it)."""
    import torch

    from deploy.local.processes import Cluster
    from syncd.net import free_port
    from trainer_svc.hf_checkpoint import load_hf, save_hf
    from trainer_svc.lora.checkpoint import load_adapter, merge_checkpoint

    summary = _run_demo(tmp_path, "--lora-rank", "8", "--steps", "3")
    work = tmp_path / "demo"
    assert summary["refits"] == summary["refits_committed"] == 3 and summary["checksums_ok"], summary
    lora = summary["lora"]
    assert lora["target_tensors"] == 7 * TINY_ARGS.num_hidden_layers, lora  # q, k, v, o, gate, up, down
    assert [p["bytes"] for p in summary["refit_phases"]] == [lora["target_bytes"]] * 3, summary
    assert lora["target_bytes"] < lora["model_bytes"], lora

    args, base = load_hf(work / "model")
    with Cluster(tmp_path / "fresh-logs") as cluster:
        for row in summary["steps"]:
            step = row["step"]
            adapter = load_adapter(work / "export" / f"step-{step}")
            reference = save_hf(
                tmp_path / f"reference-{step}",
                args,
                merge_checkpoint(base, adapter, torch.bfloat16),
                "bfloat16",
            )
            port = free_port()
            fresh = cluster.start(
                f"fresh-{step}",
                [PYTHON, "-m", "generator_svc", "--model", str(reference), "--port", str(port),
                 "--served-model-name", "tiny", "--dtype", "bfloat16", "--enforce-eager",
                 "--max-model-len", "256", "--skip-tokenizer-init"],
                env={"VLLM_CPU_KVCACHE_SPACE": "1"},
            )  # fmt: skip
            url = f"http://127.0.0.1:{port}"
            cluster.wait_http(fresh, f"{url}/healthz", 300)
            expected = _greedy(url, _prompts(work / "model"))
            assert [(t, lp) for t, lp in row["greedy"]] == expected, f"step {step}"
            fresh.stop()


def _prompts(model: Path) -> list[list[int]]:
    from deploy.local.demo import vocabulary_prompts

    return vocabulary_prompts(model, seed=0)


def _greedy(url: str, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    from deploy.local import openai_client

    api = openai_client.client(url)
    return [openai_client.complete(api, "tiny", p, max_tokens=8, temperature=0) for p in prompts]
