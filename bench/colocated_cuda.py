"""`colocated_bench.py --device cuda`: both members on one GPU, the refit over CUDA IPC
(`syncd/member/dataplane/cuda_ipc.py`) against a device-to-device copy of the same bytes.

Measured in the receiver, per round (each round runs every method once; the first warms up):
  - d2d_gbps: one device-to-device copy of the plan's bytes (one flat buffer into another);
  - refit_gbps: one refit's handshake (`IpcSender.send` / `IpcReceiver.receive`): the receiver
    starts the round, the sender posts its exports, the receiver copies every unit with the
    checksum of what it wrote, the sender checksums its regions, and the round ends when the
    sender's checksums are in the receiver's hands (where syncd would compare them);
  - handshake_ms: the same with no units (the channel's round trips, the waits for each stream).
checksums: both sides' checksums of every unit agree in every round; bit_exact: after the last
refit every destination region holds the source's bits (the destination is filled with NaNs first).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import json
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch

from syncd.layout.dtypes import torch_dtype
from syncd.member.dataplane import catalog_views
from syncd.member.dataplane.cuda_ipc import IpcReceiver, IpcSender
from syncd.member.dataplane.local_channel import SocketChannel, socket_channel
from testkit.colocated import plan_units, source_tensors

_TIMEOUT_S = 120.0
# COLOCATED_PROFILE=DIR: each member's host time in the phases rounds' offer / open and copy
# (cProfile), written to DIR/member-RANK.prof.
_PROFILE = cProfile.Profile() if os.environ.get("COLOCATED_PROFILE") else None


@contextlib.contextmanager
def _profiled() -> Iterator[None]:
    """The host work inside, profiled when COLOCATED_PROFILE is set."""
    if _PROFILE:
        _PROFILE.enable()
    try:
        yield
    finally:
        if _PROFILE:
            _PROFILE.disable()


def _sender(store: Any, args: argparse.Namespace, rounds: int) -> None:
    src_cat, _, units = plan_units(args.gib)
    sender, channel = (
        IpcSender(catalog_views(src_cat, source_tensors(args.gib))),
        socket_channel(store, "ipc-channel", listen=False, timeout_s=_TIMEOUT_S),
    )
    for r in range(rounds):
        for method, todo in (("refit", units), ("handshake", [])):
            name = f"{method}-{r}"
            channel.take(f"{name}/start", _TIMEOUT_S)
            sums = sender.offer(todo, channel, name).result()  # as an agent would: report, then wait
            channel.post(f"{name}/sums", json.dumps(sums).encode())
            sender.wait_done(channel, name, _TIMEOUT_S)
        # The same refit step by step, with the time (this host's monotonic clock) after each.
        name = f"phases-{r}"
        channel.take(f"{name}/start", _TIMEOUT_S)
        marks = {"started": time.perf_counter()}
        with _profiled():
            pending = sender.offer(units, channel, name)
        marks["offered"] = time.perf_counter()
        pending.result()
        marks["checksummed"] = time.perf_counter()
        channel.post(f"{name}/sums", json.dumps(marks).encode())
        sender.wait_done(channel, name, _TIMEOUT_S)
    channel.take("end", _TIMEOUT_S)  # the receiver's bit-exact check reads our memory until then
    sender.close()


def _receiver(store: Any, args: argparse.Namespace, rounds: int) -> dict:
    _, dst_cat, units = plan_units(args.gib)
    mine = {t.name: torch.empty(t.shape, dtype=torch_dtype(t.dtype), device="cuda") for t in dst_cat.tensors}
    views = catalog_views(dst_cat, mine)
    nbytes = sum(u.nbytes for u in units)
    flat_a = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    flat_b = torch.empty_like(flat_a)
    receiver, channel = IpcReceiver(), socket_channel(store, "ipc-channel", listen=True, timeout_s=_TIMEOUT_S)
    seconds: dict[str, list[float]] = {"d2d": [], "refit": [], "handshake": []}
    phases: list[dict[str, float]] = []
    agree = True
    for r in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        flat_b.copy_(flat_a)
        torch.cuda.synchronize()
        seconds["d2d"].append(time.perf_counter() - t0)
        for method, todo in (("refit", units), ("handshake", [])):
            if r == rounds - 1:
                for t in mine.values():
                    t.view(torch.uint8).fill_(0xFF)  # NaNs: what the last refit does not write stays wrong
            torch.cuda.synchronize()
            name = f"{method}-{r}"
            t0 = time.perf_counter()
            channel.post(f"{name}/start", b"")
            landed = receiver.receive(todo, views, channel, name, _TIMEOUT_S)
            theirs = json.loads(channel.take(f"{name}/sums", _TIMEOUT_S))
            seconds[method].append(time.perf_counter() - t0)
            agree = agree and landed == theirs and len(landed) == len(todo)
        phases.append(_receiver_phases(receiver, units, views, channel, f"phases-{r}"))
    # The source's bits, drawn again from the same seed on the same device (the sender's tensors).
    expected = catalog_views(plan_units(args.gib)[0], source_tensors(args.gib))
    exact = all(
        torch.equal(
            views[u.dst_tensor][u.dst_box.slices()].reshape(-1).view(torch.uint8),
            expected[u.src_tensor][u.src_box.slices()].reshape(-1).view(torch.uint8),
        )
        for u in units
    )
    channel.post("end", b"")
    receiver.close()
    med = {k: statistics.median(v[1:]) for k, v in seconds.items()}
    gbps = lambda s: round(nbytes / s / 1e9, 1)  # noqa: E731 - a local shorthand
    return {
        "device": "cuda",
        "gpu": torch.cuda.get_device_name(),
        "d2d_gbps": gbps(med["d2d"]),
        "refit_gbps": gbps(med["refit"]),
        "refit_over_d2d": round(med["d2d"] / med["refit"], 3),
        "handshake_ms": round(med["handshake"] * 1e3, 3),
        "checksums": agree,
        "bit_exact": exact,
        "bytes": nbytes,
        "units": len(units),
        "reps": rounds - 1,
        "seconds": {k: [round(s, 5) for s in v] for k, v in seconds.items()},
        "phases_ms": {k: round(statistics.median(p[k] for p in phases[1:]) * 1e3, 3) for k in phases[0]},
        "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _receiver_phases(
    receiver: IpcReceiver, units, views, channel: SocketChannel, name: str
) -> dict[str, float]:
    """One refit step by step: when each step ended on either side, from the receiver's start."""
    torch.cuda.synchronize()
    marks = {"start": time.perf_counter()}
    channel.post(f"{name}/start", b"")
    offer = channel.take(f"{name}/ready", _TIMEOUT_S)
    marks["receiver_took_offer"] = time.perf_counter()
    with _profiled():
        theirs = receiver.open(offer)
        marks["receiver_opened"] = time.perf_counter()
        sums = receiver.copy(units, views, theirs)
    marks["receiver_enqueued"] = time.perf_counter()
    sums.result()
    marks["receiver_has_sums"] = time.perf_counter()
    channel.post(f"{name}/done", b"ok")
    sender = json.loads(channel.take(f"{name}/sums", _TIMEOUT_S))
    marks["receiver_has_senders_sums"] = time.perf_counter()
    marks.update({f"sender_{k}": v for k, v in sender.items()})
    return {k: v - marks["start"] for k, v in marks.items() if k != "start"}


def cuda_member(rank: int, store: Any, args: argparse.Namespace) -> dict | None:
    """One member of `colocated_bench --device cuda`; the receiver (rank 1) returns the result."""
    rounds = args.reps + 1
    if rank == 0:
        _sender(store, args, rounds)
        result = None
    else:
        result = _receiver(store, args, rounds)
    if _PROFILE:
        _PROFILE.dump_stats(f"{os.environ['COLOCATED_PROFILE']}/member-{rank}.prof")
    return result
