"""deploy/slurm: node assignment and commands as tables, the commands parse with the services' own
settings, shellcheck is clean, and the launcher runs a real one-node allocation to a committed refit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from deploy_tools import REPO

from deploy.local.processes import group_members
from deploy.slurm.launcher import command
from deploy.slurm.plan import Allocation, Layout, Options, assign, expand_nodelist, launches
from syncd.auth import ENV_TOKEN_FILE, write_token_file
from syncd.net import free_port


@pytest.mark.parametrize(
    "nodelist,hosts",
    [
        ("localhost", ["localhost"]),
        ("gpu[01-03]", ["gpu01", "gpu02", "gpu03"]),
        ("gpu[01-02,07],login1", ["gpu01", "gpu02", "gpu07", "login1"]),
        ("a[8-11],b[1,3]", ["a8", "a9", "a10", "a11", "b1", "b3"]),
        ("n[009-011]", ["n009", "n010", "n011"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize(
    "nodes,generators,layout",
    [
        (("n0",), 1, Layout("n0", ("n0",), ("n0",))),
        (("n0", "n1"), 1, Layout("n0", ("n0",), ("n1",))),
        (("n0", "n1", "n2", "n3"), 2, Layout("n0", ("n0", "n1"), ("n2", "n3"))),
    ],
)
def test_assign_puts_generators_first_and_trainers_on_the_rest(nodes, generators, layout):
    assert assign(nodes, generators) == layout


@pytest.mark.parametrize("nodes,generators", [(("n0",), 2), (("n0", "n1"), 2), (("n0", "n1"), 0)])
def test_assign_refuses_allocations_without_room_for_a_trainer(nodes, generators):
    with pytest.raises(ValueError, match="generator"):
        assign(nodes, generators)


def test_allocation_from_env_checks_the_node_count():
    env = {
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "gpu[1-3]",
        "SLURM_NNODES": "3",
        "SLURMD_NODENAME": "gpu1",
    }
    assert Allocation.from_env(env, "ignored") == Allocation("7", ("gpu1", "gpu2", "gpu3"), "gpu1")
    with pytest.raises(ValueError, match="SLURM_NNODES is 2"):
        Allocation.from_env({**env, "SLURM_NNODES": "2"}, "x")
    with pytest.raises(ValueError, match="SLURM_JOB_ID"):
        Allocation.from_env({}, "x")


def test_group_members_sees_live_processes_of_a_group():
    child = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert group_members(child.pid) == [child.pid]
    finally:
        child.kill()
        child.wait()
    assert group_members(child.pid) == []


def _multi_node(token_file: str = "/job/auth-token"):
    layout = assign(("g0", "t0", "t1"), 1)
    opts = Options(
        model_dir="/ckpt",
        auth_token_file=token_file,
        trainer_nproc_per_node=8,
        generator_tp=8,
        trainer_args=("--pp", "2", "--ep", "4", "--tp", "2"),
    )
    return layout, launches(layout, opts, job_id="99")


def test_launches_parse_with_each_services_own_settings(monkeypatch, tmp_path):
    from torch.distributed.run import get_args_parser

    from generator_svc.settings import parse as parse_generator
    from syncd.daemon.settings import Settings
    from trainer_svc.settings import TrainSettings

    token = write_token_file(tmp_path / "auth-token")
    _, (syncd, generator, trainer) = _multi_node(str(tmp_path / "auth-token"))
    s = Settings.load(list(syncd.argv[3:]), environ=syncd.env)
    assert (s.expected_trainers, s.expected_generators, s.grpc_port) == (16, 8, 8471)
    assert (s.host, s.auth_token) == ("0.0.0.0", token)  # every interface of its node, with the job's token
    monkeypatch.delenv("GENERATOR_SYNCD", raising=False)
    for launch in (generator, trainer):
        assert launch.env[ENV_TOKEN_FILE] == str(tmp_path / "auth-token")
        assert not any(token in arg for arg in launch.argv)
    monkeypatch.setenv(ENV_TOKEN_FILE, generator.env[ENV_TOKEN_FILE])
    g, gargs = parse_generator([*list(generator.argv[3:]), "--data-host", "g0"])
    assert (g.syncd, g.replica, gargs.port, gargs.tensor_parallel_size) == ("g0:8471", 0, 8000, 8)
    assert g.auth_token == token
    torchrun = get_args_parser().parse_args(list(trainer.argv[3:]))
    assert (torchrun.nnodes, torchrun.rdzv_endpoint, torchrun.rdzv_id) == ("2", "t0:29400", "99")
    t = TrainSettings.from_argv([*torchrun.training_script_args, "--data-host", "t0"])
    assert t.dims.world_size == 2 * 8 == s.expected_trainers and t.syncd == "g0:8471" and t.sync_refit
    assert t.auth_token == token


def test_commands_run_local_processes_directly_and_remote_ones_through_srun():
    _, (syncd, generator, trainer) = _multi_node()
    assert command(syncd, "g0") == list(syncd.argv)
    assert command(generator, "g0")[-2:] == ["--data-host", "g0"]
    remote = command(trainer, "g0")
    assert remote[:2] == ["srun", "--overlap"] and "--nodelist=t0,t1" in remote and "--ntasks=2" in remote
    assert f"{ENV_TOKEN_FILE}=/job/auth-token" in next(a for a in remote if a.startswith("--export="))
    # every node passes its own name as the data-plane address
    assert remote[remote.index("-c") + 1] == 'exec "$@" --data-host "$SLURMD_NODENAME"'


def test_shell_scripts_pass_shellcheck():
    scripts = sorted((REPO / "deploy").rglob("*.sh")) + sorted((REPO / "deploy").rglob("*.sbatch"))
    assert scripts
    shellcheck = Path(sys.executable).with_name("shellcheck")
    result = subprocess.run(
        [str(shellcheck), "--shell=bash", *map(str, scripts)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


FAKE_PYTHON = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$RECORD.args"
trap 'echo stopped > "$RECORD.signal"; exit 0' TERM
sleep 60 & wait
"""


def test_sbatch_script_passes_launcher_flags_it_accepts_and_forwards_sigterm(tmp_path):
    from deploy.slurm.launcher import parse_args

    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    record = tmp_path / "launcher"
    env = {
        **os.environ,
        "PYTHON": str(fake),
        "RECORD": str(record),
        "MODEL_DIR": "/data/ckpt",
        "SLURM_JOB_ID": "5",
        "SLURM_GPUS_ON_NODE": "4",
        "WEIGHTSYNC_DIR": str(tmp_path),
    }
    sbatch = REPO / "deploy" / "slurm" / "weightsync.sbatch"
    script = subprocess.Popen(["bash", str(sbatch), "--cpu"], env=env)
    try:
        deadline = time.monotonic() + 20
        while not record.with_suffix(".args").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        argv = record.with_suffix(".args").read_text().splitlines()
        assert argv[:2] == ["-m", "deploy.slurm.launcher"]
        args = parse_args(argv[2:])
        assert (args.model_dir, args.trainer_nproc_per_node, args.workdir, args.cpu) == (
            "/data/ckpt",
            4,
            "weightsync-5",
            True,
        )
        time.sleep(0.5)  # let the launcher's own trap be installed
        script.send_signal(signal.SIGTERM)
        assert script.wait(20) == 143
        assert record.with_suffix(".signal").read_text().strip() == "stopped"
    finally:
        script.kill()


@pytest.mark.vllm
def test_launcher_runs_a_one_node_allocation_to_a_committed_refit(tmp_path):
    from trainer_svc.tiny import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "model")
    work = tmp_path / "job"
    env = {
        **os.environ,
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_NNODES": "1",
        "SLURM_NODEID": "0",
        "SLURMD_NODENAME": "localhost",
        "PYTHONUNBUFFERED": "1",
    }
    argv = [
        sys.executable,
        "-m",
        "deploy.slurm.launcher",
        "--model-dir",
        str(model),
        "--cpu",
        "--workdir",
        str(work),
        "--syncd-http-port",
        str(free_port()),
        "--syncd-grpc-port",
        str(free_port()),
        "--generator-port",
        str(free_port()),
        "--trainer-args",
        "--steps 1",
        "--syncd-args",
        "--bucket-bytes 1048576",
        "--ready-timeout",
        "240",
    ]
    result = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
    logs = "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in (work / "logs").glob("*.log")
    )
    assert result.returncode == 0, result.stderr[-4000:] + logs
    summary = json.loads((work / "summary.json").read_text())
    assert summary["committed_version"] == 1
    assert [(r["state"], r["weight_version"]) for r in summary["refits"]] == [("COMMITTED", 1)]
    assert summary["refits"][0]["bytes"] > 0
    assert (work / "auth-token").stat().st_mode & 0o777 == 0o600  # the job's token: its user's alone
    # Every process group it started (syncd, vLLM and its engine core, torchrun and its ranks) is gone.
    pgids = list(map(int, (work / "pids").read_text().split()))
    assert len(pgids) == 3  # syncd, generator, trainer
    left = {g: group_members(g) for g in pgids if group_members(g)}
    assert not left, f"still running after the launcher exited: {left}"


def test_launcher_stops_everything_it_started_on_sigterm(tmp_path):
    work = tmp_path / "job"
    env = {
        **os.environ,
        "SLURM_JOB_ID": "4243",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_NNODES": "1",
        "SLURMD_NODENAME": "localhost",
    }
    argv = [
        sys.executable,
        "-m",
        "deploy.slurm.launcher",
        "--model-dir",
        str(tmp_path / "no-model"),
        "--cpu",
        "--workdir",
        str(work),
        "--syncd-http-port",
        str(free_port()),
        "--syncd-grpc-port",
        str(free_port()),
        "--generator-port",
        str(free_port()),
    ]
    launcher = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        pids = work / "pids"
        while not (pids.exists() and len(pids.read_text().split()) == 2):  # syncd up, generator starting
            assert time.monotonic() < deadline and launcher.poll() is None, launcher.stderr.read().decode()
            time.sleep(0.1)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(60) == 128 + signal.SIGTERM
    finally:
        launcher.kill()
    left = {g: group_members(g) for g in map(int, pids.read_text().split()) if group_members(g)}
    assert not left, f"still running after SIGTERM: {left}"
