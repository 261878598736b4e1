"""A real SLURM cluster on one machine, on a lab of hosts (deploy.lab): munged on this machine,
slurmctld on lab host `ctl`, one slurmd on each node host (`node0`, `node1`, ...).

    with SlurmLab.start(nodes=3, workdir=Path("/tmp/slurm")) as cluster:
        job = cluster.sbatch(["deploy/slurm/weightsync.sbatch", "--cpu"], env=...)
        cluster.job_state(job)        # "RUNNING", ...; cluster.kill_node("node2")

Each daemon runs inside its host's network namespace (`nsenter --net`, which keeps this machine's
cgroups: under `ip netns exec` slurmd finds no cgroup filesystem) and in a UTS and mount namespace
of its own, where the hostname is the node's name and /etc/hosts maps every node name to its lab
address: what each node's jobs resolve (srun, torchrun's rendezvous, `--data-host`) is the lab,
as on a real cluster, and this machine's /etc/hosts is untouched. Processes are tracked by
`proctrack/linuxproc` (no cgroups needed) and `task/none`; `SlurmdParameters=config_overrides`
lets every node declare the CPUs of the node in slurm.conf. Clients (`sbatch`, `squeue`,
`scancel`) run on this machine with `SLURM_CONF` pointing at the cluster's own slurm.conf and reach
slurmctld over the lab's network; munged's socket is the cluster's own (`AuthInfo=socket=...`).

Keys, config and spool live in /run/weightsync-slurm/LAB, removed with the lab; the daemons' logs
in the caller's directory (`start`) or there too (`up`). `python -m deploy.slurm.lab_cluster up`
(`make slurm-lab`) makes a cluster that stays until `down` (`make slurm-lab-down`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from deploy.lab import Lab, net
from deploy.lab.lab import records, remove

CONTROLLER = "ctl"
DEFAULT_NAME = "wsslurm"  # the lab of `python -m deploy.slurm.lab_cluster up` (not deploy.lab's)
# Keys, config, spool: munged wants every directory above its socket searchable by all and
# writable by none but root, which a test's temporary directory (0700) is not.
STATE_ROOT = Path("/run/weightsync-slurm")
CPUS_PER_NODE = 2
# How long slurmd waits between the SIGTERM of a cancelled job's processes and their SIGKILL: the
# launcher stops every service it started within it (deploy.local.processes, 20 s per service).
KILL_WAIT_S = 30
# A node whose slurmd stops answering is DOWN after this; its jobs end as NODE_FAIL.
SLURMD_TIMEOUT_S = 10
# Which Debian package brings each daemon and client (named in the refusal).
SLURM_TOOLS = {
    "munged": "munge",
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "sbatch": "slurm-client",
    "unshare": "util-linux",
}


def hosts(nodes: int) -> list[str]:
    """The lab hosts of a cluster of `nodes` nodes: the controller, then node0, node1, ..."""
    return [CONTROLLER, *(f"node{i}" for i in range(nodes))]


def missing_requirements() -> list[str]:
    """Why no SLURM lab can run here (empty when it can): the lab's own needs, then the daemons."""
    problems = net.missing_requirements()
    for tool, package in SLURM_TOOLS.items():
        if shutil.which(tool) is None:
            problems.append(
                f"`{tool}` not found on PATH (Debian package {package}: apt-get install {package})"
            )
    return problems


def slurm_conf(cluster: str, controller_addr: str, nodes: dict[str, str], state: Path, logs: Path) -> str:
    """slurm.conf for `nodes` (name -> lab address) with slurmctld at `controller_addr`."""
    node_lines = "\n".join(
        f"NodeName={name} NodeAddr={addr} CPUs={CPUS_PER_NODE} State=UNKNOWN" for name, addr in nodes.items()
    )
    return f"""\
ClusterName={cluster}
SlurmctldHost={CONTROLLER}({controller_addr})
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={state / "munge.socket"}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={state / "slurmctld"}
SlurmdSpoolDir={state}/spool-%n
SlurmctldPidFile={state / "slurmctld.pid"}
SlurmdPidFile={state}/slurmd-%n.pid
SlurmctldLogFile={logs / "slurmctld.log"}
SlurmdLogFile={logs}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
SlurmdTimeout={SLURMD_TIMEOUT_S}
KillWait={KILL_WAIT_S}
MinJobAge=600
{node_lines}
PartitionName=lab Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


# Runs a daemon as `host`: own hostname, /etc/hosts of the lab (a private bind mount), then exec.
_AS_HOST = 'echo "$0" > /proc/sys/kernel/hostname && mount --bind "$1" /etc/hosts && shift && exec "$@"'


@dataclass
class SlurmLab:
    """munged, slurmctld and one slurmd per node of `lab`; `state` holds keys, config and spool."""

    lab: Lab
    nodes: tuple[str, ...]
    state: Path
    logs: Path  # slurmctld's and each slurmd's log

    @classmethod
    @contextlib.contextmanager
    def start(cls, nodes: int, workdir: Path, name: str) -> Iterator[SlurmLab]:
        """A lab with a controller and `nodes` nodes, the cluster up on it; on exit, failed or not,
        the lab goes (every daemon and job process in it, munged) and then the state directory."""
        logs = workdir / "daemons"
        with contextlib.ExitStack() as stack:
            stack.callback(shutil.rmtree, STATE_ROOT / name, ignore_errors=True)  # after the daemons
            lab = stack.enter_context(Lab(hosts(nodes), name=name, logs=logs))
            cluster = cls.on(lab, logs)
            cluster.up()
            yield cluster

    @classmethod
    def on(cls, lab: Lab, logs: Path | None = None) -> SlurmLab:
        """The cluster of `lab` (its hosts but the controller are the nodes); logs in the state
        directory unless `logs` is given."""
        state = STATE_ROOT / lab.name
        return cls(lab, tuple(h for h in lab.hosts if h != CONTROLLER), state, logs or state / "logs")

    @property
    def conf(self) -> Path:
        return self.state / "slurm.conf"

    def client_env(self) -> dict[str, str]:
        """What `sbatch`, `squeue`, `scancel` ... need to reach this cluster (and jobs inherit)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def up(self, timeout_s: float = 60) -> None:
        STATE_ROOT.mkdir(mode=0o755, exist_ok=True)
        remove_stale_states()
        self.state.mkdir(mode=0o755)
        self.logs.mkdir(parents=True, exist_ok=True)
        (self.state / "slurmctld").mkdir(exist_ok=True)
        self._start_munged()
        hosts = self.state / "hosts"
        addresses = {host: self.lab.address(host) for host in (CONTROLLER, *self.nodes)}
        hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for h, a in addresses.items()))
        self.conf.write_text(
            slurm_conf(
                self.lab.name,
                addresses[CONTROLLER],
                {n: addresses[n] for n in self.nodes},
                self.state,
                self.logs,
            )
        )
        self._spawn_as(CONTROLLER, ["slurmctld", "-D", "-f", str(self.conf)], "slurmctld")
        for node in self.nodes:
            self._spawn_as(node, ["slurmd", "-D", "-N", node, "-f", str(self.conf)], f"slurmd-{node}")
        self._wait_idle(timeout_s)

    def _start_munged(self) -> None:
        key = self.state / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        socket = self.state / "munge.socket"
        argv = [
            "munged",
            "--foreground",
            f"--socket={socket}",
            f"--key-file={key}",
            f"--pid-file={self.state / 'munged.pid'}",
            f"--log-file={self.logs / 'munged.log'}",
            f"--seed-file={self.state / 'munged.seed'}",
        ]
        proc = self.lab.cluster.start("munged", argv)  # on this machine: a unix socket, no network
        deadline = time.monotonic() + 20
        while not socket.exists():
            if not proc.alive() or time.monotonic() > deadline:
                raise net.LabError(f"munged did not create {socket}:\n{proc.tail()}")
            time.sleep(0.1)

    def _spawn_as(self, host: str, argv: Sequence[str], name: str) -> None:
        wrapped = ["unshare", "--uts", "--mount", "--propagation", "private", "--"]
        wrapped += ["sh", "-c", _AS_HOST, host, str(self.state / "hosts"), *argv]
        self.lab.spawn(host, wrapped, name=name)

    def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = self.node_states()
            if len(states) == len(self.nodes) and all(s == "idle" for s in states.values()):
                return
            time.sleep(0.5)
        logs = "\n".join(f"--- {p.name}\n{p.tail(15)}" for p in self.lab.cluster.procs)
        raise net.LabError(f"SLURM nodes not idle after {timeout_s:.0f} s: {states}\n{logs}")

    # ---- what a user does --------------------------------------------------------------------

    def client(self, *argv: str, env: dict[str, str] | None = None, check: bool = True) -> str:
        """Run a SLURM client command (sbatch, squeue, scancel, scontrol ...) against this cluster."""
        result = subprocess.run(
            list(argv), capture_output=True, text=True, env={**self.client_env(), **(env or {})}, timeout=60
        )
        if check and result.returncode:
            raise net.LabError(f"`{' '.join(argv)}` failed ({result.returncode}): {result.stderr.strip()}")
        return result.stdout

    def node_states(self) -> dict[str, str]:
        out = self.client("sinfo", "--noheader", "--Node", "--format=%N %t", check=False)
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def job_state(self, job_id: str) -> str:
        """The job's state (PENDING, RUNNING, COMPLETED, CANCELLED, FAILED, NODE_FAIL ...)."""
        out = self.client("scontrol", "--oneliner", "show", "job", job_id)
        return next(f.split("=", 1)[1] for f in out.split() if f.startswith("JobState="))

    def node_pids(self, node: str) -> list[int]:
        """Every process in `node`'s namespace but its slurmd (what a job left behind)."""
        # nsenter, unshare and sh exec into slurmd: the process started is the daemon itself.
        daemon = next(p for p in self.lab.cluster.procs if p.name == f"slurmd-{node}")
        return [pid for pid in net.namespace_pids(self.lab.netns(node)) if pid != daemon.popen.pid]

    def kill_node(self, node: str) -> None:
        """The node dies: SIGKILL its slurmd and every process in its namespace at once."""
        pids = net.namespace_pids(self.lab.netns(node))
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def remove_stale_states() -> list[str]:
    """Remove the state of clusters whose lab is gone (its owner was SIGKILLed and a lab's `up`
    removed the lab): stop their munged, delete their directory. Returns their names."""
    live = {record.name for record in records()}
    stale = (
        [d for d in STATE_ROOT.iterdir() if d.is_dir() and d.name not in live] if STATE_ROOT.exists() else []
    )
    for state in stale:
        _stop_munged(state)
        shutil.rmtree(state, ignore_errors=True)
    return [d.name for d in stale]


def _stop_munged(state: Path, timeout_s: float = 10) -> None:
    """SIGTERM the munged whose pid file is in `state` (if that pid is still a munged) and wait
    for it to exit: it writes its seed file into `state` on the way out."""
    try:
        pid = int((state / "munged.pid").read_text())
        if Path(f"/proc/{pid}/comm").read_text().strip() != "munged":
            return
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return  # exited; its parent (gone with `up`'s process) leaves the reaping to init
            time.sleep(0.1)
    except (OSError, ValueError):
        pass  # no pid file, or munged is gone (already, or now)


def remove_cluster(name: str) -> bool:
    """Remove cluster `name` made by `up` (another process): its lab with every daemon and job
    process in it, munged, the state directory. False if there was none."""
    existed = remove(name)
    state = STATE_ROOT / name
    existed |= state.exists()
    _stop_munged(state)
    shutil.rmtree(state, ignore_errors=True)
    return existed


def main(argv: list[str] | None = None) -> int:
    """`python -m deploy.slurm.lab_cluster up [--nodes 3] | down` (what `make slurm-lab` runs)."""
    parser = argparse.ArgumentParser(
        prog="python -m deploy.slurm.lab_cluster", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--name", default=DEFAULT_NAME, help=f"the lab's name (default {DEFAULT_NAME})")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="a persistent cluster, until `down`").add_argument(
        "--nodes", type=int, default=3
    )
    sub.add_parser("down", help="stop the cluster and its jobs, remove the lab and the state")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    problems = missing_requirements()
    if problems:
        print("error: cannot run a SLURM lab: " + "; ".join(problems), file=sys.stderr)
        return 2
    try:
        if args.command == "down":
            print(
                f"SLURM lab {args.name} removed"
                if remove_cluster(args.name)
                else f"no SLURM lab {args.name} was up"
            )
            return 0
        lab = Lab(hosts(args.nodes), name=args.name, persistent=True).up()
        cluster = SlurmLab.on(lab)
        try:
            cluster.up()
        except BaseException:
            remove_cluster(args.name)
            raise
    except net.LabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for host in lab.hosts:
        print(f"{host} {lab.address(host)}")
    print(f"export SLURM_CONF={cluster.conf}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
