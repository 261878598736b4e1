"""Start syncd, the generators and the trainer in one SLURM allocation; stop them all on exit.

    python -m deploy.slurm.launcher --model-dir /data/ckpt --generator-nodes 1 \
        --trainer-nproc-per-node 8 --generator-tp 8 --trainer-args "--pp 2 --ep 4 --steps 100"

Runs on the batch node (deploy/slurm/weightsync.sbatch calls it). It makes the job's token (256
random bits) in WORKDIR/auth-token, readable by the job's user alone, and hands every process
its path (SYNCD_AUTH_TOKEN_FILE): the token shows on no command line and in no environment;
`syncctl --token-file WORKDIR/auth-token` triggers refits. WORKDIR must be on a filesystem every
node of the allocation sees, as the model is. Processes for this node start
directly; those for other nodes through `srun --overlap` (one task per node). Waits for syncd,
then each generator, to answer /healthz, starts the trainer, waits for syncd's /readyz (or the
trainer's success, for a job shorter than a poll), then for the trainer to finish. On
SIGTERM/SIGINT, a failed process or the trainer's exit it stops everything it started
(deploy.local.processes.Cluster) and writes a summary of the refits; when signalled or when the
trainer fails, it names the allocation's nodes SLURM holds down (a node failure ends the job with
a TERM).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

from deploy.local.processes import PYTHON, Cluster, Proc
from deploy.slurm.plan import Allocation, Launch, Options, assign, launches
from syncd import http_client
from syncd.auth import write_token_file

log = logging.getLogger("slurm-launcher")
TOKEN_FILE = "auth-token"  # in the workdir


def command(launch: Launch, this_node: str) -> list[str]:
    """The argv that runs `launch`: directly when it is for this node alone, else through srun."""
    if launch.nodes == (this_node,):
        return [*launch.argv, *(("--data-host", this_node) if launch.data_host_flag else ())]
    argv = list(launch.argv)
    if launch.data_host_flag:  # each node's own name, known only inside the task
        argv = ["bash", "-c", 'exec "$@" --data-host "$SLURMD_NODENAME"', "bash", *argv]
    exports = ",".join(["ALL", *(f"{k}={v}" for k, v in launch.env.items())])
    return [
        "srun",
        "--overlap",
        "--kill-on-bad-exit=1",
        f"--nodes={len(launch.nodes)}",
        f"--ntasks={len(launch.nodes)}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(launch.nodes)}",
        f"--export={exports}",
        *argv,
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m deploy.slurm.launcher", description=__doc__.splitlines()[0])
    p.add_argument(
        "--model-dir", required=True, help="starting HF checkpoint, on a filesystem every node sees"
    )
    p.add_argument("--generator-nodes", type=int, default=1)
    p.add_argument("--generator-tp", type=int, default=1, help="vLLM tensor parallelism per generator")
    p.add_argument("--trainer-nproc-per-node", type=int, default=1)
    p.add_argument("--syncd-http-port", type=int, default=8470)
    p.add_argument("--syncd-grpc-port", type=int, default=8471)
    p.add_argument("--generator-port", type=int, default=8000)
    p.add_argument("--rdzv-port", type=int, default=29400)
    p.add_argument(
        "--no-auto-refit",
        dest="auto_refit",
        action="store_false",
        help="do not start a refit on each trainer step (trigger them with syncctl)",
    )
    p.add_argument(
        "--cpu", action="store_true", help="CPU everywhere: gloo, vLLM on CPU, trainer --device cpu"
    )
    p.add_argument("--syncd-args", default="", help="more syncd flags, one shell-quoted string")
    p.add_argument("--generator-args", default="", help="more generator_svc / vllm serve flags")
    p.add_argument("--trainer-args", default="", help="more trainer_svc flags (--pp --ep --tp --steps ...)")
    p.add_argument(
        "--workdir", default=None, help="logs, syncd.db and summary.json (default ./weightsync-JOBID)"
    )
    p.add_argument("--ready-timeout", type=float, default=900, help="seconds to wait for each service")
    return p.parse_args(argv)


def options(args: argparse.Namespace, workdir: Path) -> Options:
    return Options(
        model_dir=args.model_dir,
        auth_token_file=str(workdir / TOKEN_FILE),
        syncd_db=str(workdir / "syncd.db"),
        trainer_nproc_per_node=args.trainer_nproc_per_node,
        generator_tp=args.generator_tp,
        syncd_http_port=args.syncd_http_port,
        syncd_grpc_port=args.syncd_grpc_port,
        generator_port=args.generator_port,
        rdzv_port=args.rdzv_port,
        auto_refit=args.auto_refit,
        cpu=args.cpu,
        syncd_args=tuple(shlex.split(args.syncd_args)),
        generator_args=tuple(shlex.split(args.generator_args)),
        trainer_args=tuple(shlex.split(args.trainer_args)),
    )


def run(args: argparse.Namespace, alloc: Allocation, workdir: Path) -> int:
    layout = assign(alloc.nodes, args.generator_nodes)
    specs = launches(layout, options(args, workdir), alloc.job_id, PYTHON)
    syncd_spec, *generator_specs, trainer_spec = specs
    log.info(
        "job %s: syncd on %s, generators on %s, trainer on %s",
        alloc.job_id,
        layout.syncd,
        ",".join(layout.generators),
        ",".join(layout.trainers),
    )
    syncd_url = f"http://{layout.syncd}:{args.syncd_http_port}"
    pids = workdir / "pids"
    pids.write_text("")
    cluster = Cluster(workdir / "logs")

    def start(spec: Launch) -> Proc:
        proc = cluster.start(spec.name, command(spec, alloc.this_node), env=spec.env)
        with pids.open("a") as f:
            f.write(f"{proc.popen.pid}\n")
        return proc

    try:
        syncd = start(syncd_spec)
        cluster.wait_http(syncd, f"{syncd_url}/healthz", args.ready_timeout)
        generators = [start(spec) for spec in generator_specs]
        for proc, spec in zip(generators, generator_specs):
            url = f"http://{spec.nodes[0]}:{args.generator_port}/healthz"
            cluster.wait_http(proc, url, args.ready_timeout)
        log.info("syncd and %d generator(s) up; starting the trainer", len(generators))
        trainer = start(trainer_spec)
        # A short job can register, train, refit and leave syncd between two polls: its exit
        # with status 0 ends this wait too (the summary below says what it moved).
        cluster.wait_http(trainer, f"{syncd_url}/readyz", args.ready_timeout, finished_ok=True)
        if trainer.alive():
            log.info("syncd ready: every trainer rank and generator worker registered")
        rc = _wait_trainer(trainer, [syncd, *generators])
        if rc:
            _report_lost_nodes(alloc.nodes)
        _write_summary(workdir / "summary.json", syncd_url, rc)
        return rc
    except SystemExit:  # SIGTERM/SIGINT: scancel, the time limit, or SLURM ending a job on node failure
        # SLURM signals every process of the job and the script forwards the TERM too: a second
        # signal must not cut the report (or the cleanup below) short.
        _ignore_signals()
        _report_lost_nodes(alloc.nodes)
        raise
    finally:  # also on a timeout, a dead service or SIGTERM/SIGINT (raised as SystemExit)
        _ignore_signals()
        cluster.stop()


def _ignore_signals() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def _wait_trainer(trainer: Proc, services: list[Proc]) -> int:
    while trainer.alive():
        dead = [p for p in services if not p.alive()]
        if dead:
            log.error("%s exited with %s:\n%s", dead[0].name, dead[0].popen.returncode, dead[0].tail())
            return 1
        time.sleep(1)
    rc = trainer.popen.returncode
    if rc == 0:
        log.info("trainer finished")
    else:
        log.error("trainer exited with %d:\n%s", rc, trainer.tail())
    return rc


def _report_lost_nodes(nodes: tuple[str, ...]) -> None:
    """Name the allocation's nodes SLURM holds down or not responding: when a node fails, SLURM
    ends the job with a TERM, and this says which node it was, in the job's own output."""
    argv = ["sinfo", "--noheader", "--Node", f"--nodes={','.join(nodes)}", "--format=%N %T %E"]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return  # no SLURM to ask (a simulated allocation); the services' logs still say what failed
    for line in sorted(set(out.splitlines())):
        node, state, reason = [*line.split(maxsplit=2), "", ""][:3]
        if state.endswith("*") or state.startswith(("down", "drain", "fail")):  # `*`: not responding
            log.error("node %s of this allocation is lost: %s (%s)", node, state, reason.strip())


def _write_summary(path: Path, syncd_url: str, trainer_rc: int) -> None:
    refits = http_client.get(f"{syncd_url}/v1/refits", timeout=30).json()["refits"]
    status = http_client.get(f"{syncd_url}/v1/status", timeout=30).json()
    fields = ("id", "state", "weight_version", "bytes", "error")
    summary = {
        "trainer_exit_code": trainer_rc,
        "committed_version": status["committed_version"],
        "refits": [{k: r.get(k) for k in fields} for r in refits],
    }
    path.write_text(json.dumps(summary, indent=2) + "\n")
    log.info("summary: %s", json.dumps(summary))


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through run()'s finally, which stops every child


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s slurm-launcher %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_on_signal)
    try:
        alloc = Allocation.from_env(os.environ, socket.gethostname())
        workdir = Path(args.workdir or f"weightsync-{alloc.job_id}").resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / TOKEN_FILE).unlink(missing_ok=True)  # a rerun in this workdir gets a fresh token
        write_token_file(workdir / TOKEN_FILE)
        return run(args, alloc, workdir)
    except (ValueError, TimeoutError, RuntimeError) as e:
        log.error("%s", e)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
