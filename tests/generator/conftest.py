"""Fixtures for generator_svc tests: tiny checkpoints and running services (real vLLM on CPU).

Engines are expensive (~20 s each on 2 cores), so one service on checkpoint A is shared by the
session and a fresh engine on checkpoint B is started alongside it only to record reference
outputs. Tests that change the served weights put A back before they finish.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from syncd.net import free_port
from tests.engines import ENGINE_FLAGS
from trainer_svc.tiny import make_tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]
PROMPTS = {"short": [1, 2, 3, 4, 5], "long": [(i * 37 + 11) % 512 for i in range(200)]}
MAX_TOKENS = 8


def engine_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.update(extra)
    return env


class Service:
    """`python -m generator_svc` in its own process group, driven over HTTP."""

    def __init__(self, model: Path, log: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        command = [sys.executable, "-m", "generator_svc", "--model", str(model), "--port", str(self.port)]
        with open(log, "w") as out:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [*command, "--dtype", "float32", *ENGINE_FLAGS, *args],
                cwd=REPO,
                env=env or engine_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.http = httpx.Client(base_url=self.url, timeout=120)

    def wait_ready(self, timeout: float = 300) -> Service:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"generator exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if self.http.get("/healthz").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"generator not ready after {timeout}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def complete(self, prompt: list[int], max_tokens: int = MAX_TOKENS) -> tuple[list[int], list[float]]:
        """Greedy tokens and their logprobs (token ids, not text: the tiny model has no tokenizer)."""
        r = self.http.post(
            "/v1/completions",
            json={
                "model": "tiny",
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "logprobs": 1,
                "detokenize": False,
                "return_tokens_as_token_ids": True,
            },
        )
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        return [int(t.removeprefix("token_id:")) for t in lp["tokens"]], lp["token_logprobs"]

    def outputs(self) -> dict[str, tuple[list[int], list[float]]]:
        return {name: self.complete(p) for name, p in PROMPTS.items()}

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.http.close()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {"A": make_tiny_checkpoint(root / "A", seed=0), "B": make_tiny_checkpoint(root / "B", seed=1)}


@pytest.fixture(scope="session")
def _launched(checkpoints, tmp_path_factory):
    """Start the shared A service and the reference B engine together (their inits overlap). A
    starts its engine as generator_svc does (fork), B as vLLM does (spawn): the tests that refit A
    to B and compare it with B token for token also hold the two ways of starting equal."""
    logs = tmp_path_factory.mktemp("logs")
    services = {
        "A": Service(checkpoints["A"], logs / "A.log"),
        "B": Service(checkpoints["B"], logs / "B.log", "--engine-start", "spawn"),
    }
    yield services
    for s in services.values():
        s.stop()


@pytest.fixture(scope="session")
def service_a(_launched) -> Service:
    return _launched["A"].wait_ready()


@pytest.fixture(scope="session")
def outputs_a(service_a: Service) -> dict:
    """What the A service generates before any refit."""
    return service_a.outputs()


@pytest.fixture(scope="session")
def outputs_fresh_b(_launched) -> dict:
    """What a fresh engine started on B generates (the engine is stopped afterwards)."""
    b = _launched["B"].wait_ready()
    try:
        return b.outputs()
    finally:
        b.stop()
