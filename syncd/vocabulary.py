"""The fixed vocabularies the daemon and the members share, declared once.

Each is a `StrEnum`: a member is also the plain string it names, so protobuf fields, JSON bodies,
SQLite rows, metric labels and command-line flags carry the same text as before, and a value
parsed from any of them compares equal to its member. This module imports nothing of the
project, so every layer (`syncd.plan`, `syncd.member`, `syncd.daemon`, the services) can use it.
"""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    """What a member is to syncd: trainers send weights, generators receive them."""

    TRAINER = "trainer"
    GENERATOR = "generator"


class Direction(StrEnum):
    """Which way one member's side of a transfer moves its buckets."""

    SEND = "send"
    RECV = "recv"


class Backend(StrEnum):
    """The data plane of a stage group: gloo on CPU members, NCCL (nccl4py) when all are on GPUs."""

    GLOO = "gloo"
    NCCL = "nccl"


class Fp8Part(StrEnum):
    """Which half of a blockwise-FP8 destination weight a transfer unit carries
    (`syncd.plan.fp8_blocks`): the e4m3 values, or their float32 per-block scales."""

    VALUES = "values"
    SCALES = "scales"


class LinkTransport(StrEnum):
    """What carries one link (sender -> receiver) of a plan: the stage group's backend, or, between
    members that reported the same host, shared memory (gloo groups) or CUDA IPC (NCCL groups whose
    members all share memory) (`syncd.plan.transports`)."""

    SHM = "shm"
    CUDA_IPC = "cuda_ipc"
    GLOO = "gloo"
    NCCL = "nccl"


class SameHost(StrEnum):
    """syncd's choice for members of one host (`SYNCD_SAME_HOST`): shared memory (and CUDA IPC
    between members that share GPU memory), or the network backend as between hosts."""

    SHM = "shm"
    NETWORK = "network"
