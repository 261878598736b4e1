"""Who runs where in one SLURM allocation, and with which command: pure functions of the
allocation (SLURM's environment) and the launcher's options, so they are tested as tables.

    nodes:      n0          n1 ... n(G-1)       nG ... n(N-1)
    runs:       syncd       generator 1..G-1    trainer (torchrun, one task per node)
                generator 0

syncd is a small CPU process and shares the first node with the first generator. A one-node
allocation runs everything on that node (a demo, or the test on a workstation). syncd serves
every interface of its node, so every process gets the job's token file (`auth_token_file`,
SYNCD_AUTH_TOKEN_FILE in its environment): its path, never the token, is what they are handed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from syncd.auth import ENV_TOKEN_FILE


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list (`gpu[01-03,07],login1`) as host names, in order."""
    hosts: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not hi:
                hosts.append(prefix + lo)
            else:
                hosts += [prefix + str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]
    if not hosts:
        raise ValueError(f"SLURM_JOB_NODELIST {nodelist!r} names no hosts")
    return hosts


@dataclass(frozen=True)
class Allocation:
    job_id: str
    nodes: tuple[str, ...]
    this_node: str  # where the batch script (and so the launcher) runs

    @staticmethod
    def from_env(environ: Mapping[str, str], hostname: str) -> Allocation:
        missing = [v for v in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NNODES") if v not in environ]
        if missing:
            raise ValueError(f"not inside a SLURM allocation: {', '.join(missing)} unset")
        nodes = tuple(expand_nodelist(environ["SLURM_JOB_NODELIST"]))
        if len(nodes) != int(environ["SLURM_NNODES"]):
            raise ValueError(
                f"SLURM_JOB_NODELIST has {len(nodes)} hosts but SLURM_NNODES is {environ['SLURM_NNODES']}"
            )
        return Allocation(environ["SLURM_JOB_ID"], nodes, environ.get("SLURMD_NODENAME", hostname))


@dataclass(frozen=True)
class Layout:
    syncd: str
    generators: tuple[str, ...]
    trainers: tuple[str, ...]


def assign(nodes: tuple[str, ...], generator_nodes: int) -> Layout:
    if generator_nodes < 1:
        raise ValueError(f"generator_nodes must be >= 1, got {generator_nodes}")
    if len(nodes) == 1 and generator_nodes == 1:
        return Layout(nodes[0], nodes, nodes)
    if len(nodes) <= generator_nodes:
        raise ValueError(
            f"{len(nodes)} node(s) cannot hold {generator_nodes} generator node(s) and at least "
            f"one trainer node; allocate more nodes or lower --generator-nodes"
        )
    return Layout(nodes[0], nodes[:generator_nodes], nodes[generator_nodes:])


@dataclass(frozen=True)
class Options:
    """What the launcher was asked for (its command line), minus where things run."""

    model_dir: str
    auth_token_file: str  # the job's token (the launcher writes it), on a filesystem every node sees
    syncd_db: str = "syncd.db"
    trainer_nproc_per_node: int = 1
    generator_tp: int = 1
    syncd_http_port: int = 8470
    syncd_grpc_port: int = 8471
    generator_port: int = 8000
    rdzv_port: int = 29400
    auto_refit: bool = True
    cpu: bool = False
    syncd_args: tuple[str, ...] = ()
    generator_args: tuple[str, ...] = ()
    trainer_args: tuple[str, ...] = ()


# What vLLM needs to serve the tiny model on CPU (see deploy/local/demo.py).
CPU_GENERATOR_ARGS = (
    "--dtype",
    "float32",
    "--enforce-eager",
    "--max-model-len",
    "256",
    "--skip-tokenizer-init",
)
CPU_GENERATOR_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


@dataclass(frozen=True)
class Launch:
    """One process to start: `argv` on each of `nodes` (one task per node)."""

    name: str
    nodes: tuple[str, ...]
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    # Appended per node as `--data-host <that node>` (the data plane listens on the node's address).
    data_host_flag: bool = False


def launches(layout: Layout, opts: Options, job_id: str, python: str = "python") -> list[Launch]:
    """syncd, then one launch per generator node, then the trainer (one torchrun per node)."""
    syncd_addr = f"{layout.syncd}:{opts.syncd_grpc_port}"
    token = {ENV_TOKEN_FILE: opts.auth_token_file}
    syncd = Launch(
        "syncd",
        (layout.syncd,),
        (
            python,
            "-m",
            "syncd",
            "--host",
            "0.0.0.0",
            "--db",
            opts.syncd_db,
            "--http-port",
            str(opts.syncd_http_port),
            "--grpc-port",
            str(opts.syncd_grpc_port),
            "--expected-trainers",
            str(len(layout.trainers) * opts.trainer_nproc_per_node),
            "--expected-generators",
            str(len(layout.generators) * opts.generator_tp),
            *(("--auto-refit",) if opts.auto_refit else ()),
            *(("--backend", "gloo") if opts.cpu else ()),
            *opts.syncd_args,
        ),
        dict(token),
    )
    generators = [
        Launch(
            f"generator-{i}",
            (node,),
            (
                python,
                "-m",
                "generator_svc",
                "--model",
                opts.model_dir,
                "--syncd",
                syncd_addr,
                "--replica",
                str(i),
                "--port",
                str(opts.generator_port),
                "--tensor-parallel-size",
                str(opts.generator_tp),
                *(CPU_GENERATOR_ARGS if opts.cpu else ()),
                *opts.generator_args,
            ),
            {**token, **(CPU_GENERATOR_ENV if opts.cpu else {})},
            data_host_flag=True,
        )
        for i, node in enumerate(layout.generators)
    ]
    if len(layout.trainers) == 1:
        rendezvous: tuple[str, ...] = ("--standalone",)
    else:
        rendezvous = (
            "--nnodes",
            str(len(layout.trainers)),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{layout.trainers[0]}:{opts.rdzv_port}",
            "--rdzv-id",
            job_id,
        )
    trainer = Launch(
        "trainer",
        layout.trainers,
        (
            python,
            "-m",
            "torch.distributed.run",
            *rendezvous,
            "--nproc-per-node",
            str(opts.trainer_nproc_per_node),
            "-m",
            "trainer_svc",
            "--model-dir",
            opts.model_dir,
            "--syncd",
            syncd_addr,
            "--sync-refit",
            *(("--device", "cpu") if opts.cpu else ()),
            *opts.trainer_args,
        ),
        {**token, **({"OMP_NUM_THREADS": "1"} if opts.cpu else {})},
        data_host_flag=True,
    )
    return [syncd, *generators, trainer]
