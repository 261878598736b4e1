"""A real syncd and two member processes (a trainer rank and a vLLM-shaped generator worker,
`ipc_member.py`) on one GPU, or on two GPUs of one host that read each other's memory: they report
where they run, so syncd makes their group a CUDA IPC group, shows it in the plan, and two refits
commit with every byte checked end to end."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from syncd.refit_wait import wait_final

pytestmark = pytest.mark.gpu(count=1)

try:  # GPU machines may lack syncd's own dependencies (docs/testing.md: carry their wheels)
    from syncd.daemon.service import Daemon
    from tests.syncd_settings import syncd_settings
except (ImportError, RuntimeError) as e:  # grpc's stubs raise RuntimeError on an older grpcio
    pytest.skip(f"syncd cannot start here: {e}", allow_module_level=True)

MEMBER = Path(__file__).with_name("ipc_member.py")


def _ask(proc: subprocess.Popen, line: str) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def test_syncd_carries_a_one_gpu_link_through_cuda_ipc_and_commits(tmp_path):
    _two_refits_through_cuda_ipc(tmp_path, {"trainer": "cuda:0", "generator": "cuda:0"})


@pytest.mark.gpu(count=2)
def test_syncd_carries_a_link_between_peer_gpus_through_cuda_ipc_and_commits(tmp_path):
    _two_refits_through_cuda_ipc(tmp_path, {"trainer": "cuda:0", "generator": "cuda:1"})


def _two_refits_through_cuda_ipc(tmp_path, devices: dict[str, str]) -> None:
    settings = syncd_settings(
        tmp_path,
        lease_seconds=5,
        expected_trainers=1,
        expected_generators=1,
        bucket_bytes=1 << 20,
        backend="auto",
    )
    daemon = Daemon(settings)
    daemon.start()
    procs = {
        role: subprocess.Popen(
            [sys.executable, str(MEMBER), role, f"127.0.0.1:{daemon.grpc_port}", device],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for role, device in devices.items()
    }
    http = httpx.Client(base_url=f"http://127.0.0.1:{settings.http_port}", timeout=30)
    try:
        deadline = time.monotonic() + 120
        while not http.get("/readyz").json()["ready"]:
            assert time.monotonic() < deadline, http.get("/readyz").json()
            time.sleep(0.2)
        links = http.get("/v1/plan").json()["links"]
        assert links and {k["transport"] for k in links} == {"cuda_ipc"}, links

        for version in (1, 2):
            assert _ask(procs["trainer"], f"load {version}") == f"loaded {version}"
            r = http.post("/v1/refits", json={"weight_version": version})
            assert r.status_code == 202, r.text
            final = wait_final(lambda path: http.get(path).json(), r.json()["id"], 120, poll_s=0.1)
            assert final["state"] == "COMMITTED", final
            assert _ask(procs["generator"], f"check {version}") == f"ok {version}"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                _ask(proc, "quit")
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        http.close()
        daemon.stop()
