"""A byte changed inside a receiving vLLM worker after its bucket's checksum, before or while it is
unpacked or installed, is caught on every refit, in staged and inplace modes, at TP 1 and 2
(`syncd.member.dataplane.landed`, armed by `WEIGHTSYNC_TEST_LANDING_FAULT_FILE`).

One generator per (mode, TP) takes many refits from a real syncd and a one-rank trainer
(`FakeTrainer`): faulty ones, every one aborted naming a tensor with the previous version still
served (staged) or generation refused (inplace, whose layers were written in place), then a good
one, committed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from syncd.member.dataplane.landing_fault import LANDING_FAULT_ENV, LandingFault
from syncd.refit_wait import wait_final
from tests.generator.conftest import REPO, Service, engine_env, free_port
from tests.generator.process_memory import descendants, flip_everywhere
from tests.generator.test_generator_syncd import FakeTrainer
from trainer_svc.canonical import random_canonical
from trainer_svc.tiny import TINY_ARGS

pytestmark = pytest.mark.vllm

FAULTS = [LandingFault.AFTER_CHECKSUM, LandingFault.RACING] * 3  # repeated: the race goes both ways


def _syncd(tmp_path: Path) -> tuple[subprocess.Popen, str, httpx.Client]:
    """syncd with 64 KiB buckets, so a refit of the tiny model is dozens of buckets; gloo on every
    link (FakeTrainer speaks plain gloo, not the shared-memory transport)."""
    grpc_port, http_port = free_port(), free_port()
    args = ["--grpc-port", str(grpc_port), "--http-port", str(http_port), "--db", str(tmp_path / "syncd.db")]
    with open(tmp_path / "syncd.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "syncd", *args, "--bucket-bytes", str(1 << 16), "--same-host", "network"],
            cwd=REPO,
            env=engine_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    http = httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=10)
    _wait("syncd /healthz", lambda: _answers(http, "/healthz"), 30)
    return proc, f"127.0.0.1:{grpc_port}", http


def _answers(http: httpx.Client, path: str) -> bool:
    try:
        return http.get(path).status_code == 200
    except httpx.TransportError:
        return False


def _wait(what: str, condition, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


class Stack:
    def __init__(self, mode: str, tp: int, checkpoints: dict[str, Path], tmp_path: Path) -> None:
        self.mode, self.tp, self.fault_file = mode, tp, tmp_path / "fault"
        self.proc, target, self.syncd = _syncd(tmp_path)
        env = engine_env(**{LANDING_FAULT_ENV: str(self.fault_file)})
        if tp == 2:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
        self.generator = Service(
            checkpoints["A"],
            tmp_path / "generator.log",
            "--syncd",
            target,
            "--refit-mode",
            mode,
            "--tensor-parallel-size",
            str(tp),
            env=env,
        )
        self.trainer: FakeTrainer | None = None
        try:
            self.generator.wait_ready()
            self.trainer = FakeTrainer(target, checkpoints["B"])  # holds B as version 1
            _wait("syncd ready", lambda: self.syncd.get("/readyz").status_code == 200)
        except BaseException:
            self.close()
            raise

    def refit(self, fault: LandingFault | None) -> dict:
        if fault is None:
            self.fault_file.unlink(missing_ok=True)
        else:
            self.fault_file.write_text(str(fault))
        try:
            r = self.syncd.post("/v1/refits", json={"weight_version": 1})
            assert r.status_code == 202, r.text
            return wait_final(lambda path: self.syncd.get(path).json(), r.json()["id"], 180)
        finally:
            self.fault_file.unlink(missing_ok=True)

    def served(self) -> dict:
        return _wait(
            "the hold to end",
            lambda: (s := self.generator.http.get("/v1/weight_version").json()) and not s["updating"] and s,
        )

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()
        self.generator.stop()
        self.proc.terminate()
        self.proc.wait(10)
        self.syncd.close()


@pytest.fixture(
    scope="module",
    params=[("staged", 1), ("inplace", 1), ("staged", 2), ("inplace", 2)],
    ids=lambda p: f"{p[0]}-tp{p[1]}",
)
def stack(request, checkpoints, tmp_path_factory) -> Iterator[Stack]:
    mode, tp = request.param
    s = Stack(mode, tp, checkpoints, tmp_path_factory.mktemp(f"landing-{mode}-tp{tp}"))
    yield s
    s.close()


def test_every_changed_byte_aborts_the_refit_and_a_good_refit_then_commits(stack: Stack) -> None:
    before = stack.generator.outputs()
    for n, fault in enumerate(FAULTS):
        refit = stack.refit(fault)
        assert refit["state"] == "ABORTED", (n, fault, refit, stack.generator.log_tail())
        # Named by syncd's comparison of the senders' checksums with the receiver's, which are
        # of where each unit landed (`syncd.member.dataplane.landed`): tensor and region.
        error = refit["error"]
        assert "tensor model." in error and "checksum mismatch" in error, (fault, error)
        served = stack.served()
        if stack.mode == "staged":
            assert served["version"] == "0" and served["serving"], served
            assert stack.generator.outputs() == before, f"after {fault}: not the previous version"
        else:  # layers were written in place: mixed weights are refused until a good refit
            assert not served["serving"], served
            api = stack.generator.http.post(
                "/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}
            )
            assert api.status_code == 503, api.text
    refit = stack.refit(None)
    assert refit["state"] == "COMMITTED", (refit, stack.generator.log_tail())
    served = stack.served()
    assert served["version"] == "1" and served["serving"], served
    assert stack.generator.outputs() != before
    _check_verify(stack)


def _syncctl(stack: Stack, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "syncd.cli", "--url", str(stack.syncd.base_url), *args],
        cwd=REPO,
        env=engine_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _check_verify(stack: Stack) -> None:
    """`syncctl verify`: staged workers hold what the trainer sent (every worker, every region),
    until a byte of them changes; inplace workers say why they cannot."""
    done = _syncctl(stack, "verify", "--generator", stack.generator.url)
    if stack.mode == "inplace":
        assert done.returncode == 1 and "--refit-mode inplace keeps no copy" in done.stderr, done
        return
    assert done.returncode == 0 and "equal:" in done.stdout, (done.stdout, done.stderr)
    workers = stack.generator.http.get("/v1/weights/digest").json()
    assert [w["member_id"] for w in workers] == [f"generator-0-{r}" for r in range(stack.tp)]
    recorded = stack.syncd.get("/v1/digest").json()
    assert recorded["weight_version"] == 1
    assert all(w["checksums"] == recorded["members"][w["member_id"]] for w in workers)
    _corrupt_and_verify(stack)


# One float of the served version's row 0 (in every TP rank's share: o_proj splits by columns).
CORRUPTED = "model.layers.1.self_attn.o_proj.weight"


def _corrupt_and_verify(stack: Stack) -> None:
    """A deliberate corruption outside a refit: one float of the served weights changed in the
    generator's processes from outside, as a stray write would (through /proc/PID/mem, no hook in
    the generator); `syncctl verify` then names that tensor, and only it."""
    if os.geteuid() != 0:
        pytest.skip("changing another process's memory needs root")
    trainer_b = random_canonical(TINY_ARGS, seed=1)  # checkpoint B: what FakeTrainer sent
    pattern = trainer_b[CORRUPTED][0, :16].numpy().tobytes()
    try:
        flipped = sum(flip_everywhere(pid, pattern) for pid in descendants(stack.generator.proc.pid))
    except PermissionError as e:  # root without CAP_SYS_PTRACE, or Yama's ptrace_scope 3
        pytest.skip(f"this machine forbids writing another process's memory: {e}")
    assert flipped >= 1, "the served row was not found in the generator's memory"
    done = _syncctl(stack, "verify", "--generator", stack.generator.url)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert f"DIFFERENT: {CORRUPTED}\n" in done.stderr, done.stderr
    table = done.stderr.split("DIFFERENT:", 1)[1].splitlines()[1:]  # member, region, sent, holds
    differing = [line for line in table if line.startswith("generator-0-")]
    assert differing and all(f" {CORRUPTED}[" in line for line in differing), done.stderr
