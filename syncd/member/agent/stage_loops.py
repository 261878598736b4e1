"""The loop that carries one stage group's part of a transfer, by what this member does there
(`LoopKind`): one entry of `_LOOPS` per kind, each called with the stage's `StageTransfer`.

A CUDA IPC group has no network transport: all of its buckets go over the links syncd named.
Elsewhere a relay (fan-out) receives and forwards, a sender sends, a receiver receives; each of
them through its delta loop when it takes part in a delta refit (`SenderMirror.delta_part`: a
relay gets delta links as a receiver).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import Enum

from syncd.member.agent.loop_args import StageTransfer
from syncd.member.dataplane import TransferError, TransferStats, recv_buckets, send_buckets
from syncd.member.dataplane.delta import recv_with_deltas, send_with_deltas
from syncd.member.dataplane.relay import relay_buckets, relay_with_deltas
from syncd.plan.transports import ipc_refusal


class LoopKind(Enum):
    CUDA_IPC = "cuda_ipc"
    RELAY = "relay"
    RELAY_DELTAS = "relay_deltas"
    SEND = "send"
    SEND_DELTAS = "send_deltas"
    RECV = "recv"
    RECV_DELTAS = "recv_deltas"


def loop_kind(s: StageTransfer) -> LoopKind:
    if s.group.ipc is not None:
        return LoopKind.CUDA_IPC
    deltas = s.refit.delta is not None
    if s.relaying:
        return LoopKind.RELAY_DELTAS if deltas else LoopKind.RELAY
    if s.sending:
        return LoopKind.SEND_DELTAS if deltas else LoopKind.SEND
    return LoopKind.RECV_DELTAS if deltas else LoopKind.RECV


def run_stage_loop(s: StageTransfer) -> TransferStats:
    """This member's buckets of one stage, moved by the loop its part there calls for."""
    return _LOOPS[loop_kind(s)](s)


def _cuda_ipc(s: StageTransfer) -> TransferStats:
    """This member's buckets in a CUDA IPC group: all of them over the links syncd named
    (`ipc_links`); one CUDA IPC cannot carry has no other way there."""
    group = s.group
    assert group.ipc is not None
    refused = [b for b in s.buckets if (b.stage, b.src, b.dst) not in s.refit.ipc_links]
    if refused:
        links = sorted({f"{b.src} -> {b.dst}" for b in refused})
        raise TransferError(
            f"links {', '.join(links)} cannot go through CUDA IPC "
            f"({ipc_refusal(refused) or 'not chosen by syncd'}), and group {group.group_id} has no "
            "NCCL communicator: it is a CUDA IPC group"
        )
    tensors = s.refit.tensors
    if not isinstance(tensors, Mapping):
        raise TransferError(f"{s.refit.member_id} installs as buckets arrive; CUDA IPC copies into staging")
    if s.sending:
        return group.ipc.send(s.buckets, tensors, s.ranks, s.refit.refit_id, 2 * s.refit.wait_s)
    return group.ipc.receive(s.buckets, tensors, s.ranks, s.refit.refit_id, s.refit.wait_s)


def _relay(s: StageTransfer) -> TransferStats:
    return relay_buckets(
        s.buckets,
        s.refit.member_id,
        s.named_tensors,
        s.transport,
        s.ranks,
        s.options,
        cancel=s.refit.cancel,
        cache=s.cache,
        forward_timeout_s=s.forward_timeout_s,
    )


def _relay_deltas(s: StageTransfer) -> TransferStats:
    assert s.refit.delta is not None  # `loop_kind`
    return relay_with_deltas(
        s.buckets,
        s.refit.member_id,
        s.named_tensors,
        s.transport,
        s.ranks,
        s.refit.delta,
        s.options,
        cancel=s.refit.cancel,
        cache=s.cache,
        forward_timeout_s=s.forward_timeout_s,
    )


def _send(s: StageTransfer) -> TransferStats:
    return send_buckets(
        s.buckets, s.named_tensors, s.transport, s.ranks, s.options, cancel=s.refit.cancel, cache=s.cache
    )


def _send_deltas(s: StageTransfer) -> TransferStats:
    delta, diffs = s.refit.delta, s.refit.diffs
    # `SenderMirror.delta_part` gives every sender its comparisons
    assert delta is not None and diffs is not None
    return send_with_deltas(
        s.buckets,
        s.named_tensors,
        s.transport,
        s.ranks,
        delta,
        diffs,
        s.options,
        cancel=s.refit.cancel,
        cache=s.cache,
    )


def _recv(s: StageTransfer) -> TransferStats:
    return recv_buckets(
        s.buckets, s.refit.tensors, s.transport, s.ranks, s.options, cancel=s.refit.cancel, cache=s.cache
    )


def _recv_deltas(s: StageTransfer) -> TransferStats:
    assert s.refit.delta is not None  # `loop_kind`
    return recv_with_deltas(
        s.buckets,
        s.named_tensors,
        s.transport,
        s.ranks,
        s.refit.delta,
        s.options,
        cancel=s.refit.cancel,
        cache=s.cache,
    )


_LOOPS: dict[LoopKind, Callable[[StageTransfer], TransferStats]] = {
    LoopKind.CUDA_IPC: _cuda_ipc,
    LoopKind.RELAY: _relay,
    LoopKind.RELAY_DELTAS: _relay_deltas,
    LoopKind.SEND: _send,
    LoopKind.SEND_DELTAS: _send_deltas,
    LoopKind.RECV: _recv,
    LoopKind.RECV_DELTAS: _recv_deltas,
}
