"""An abort ends NCCL transfers at once: a trainer rank blocked sending to a generator that stopped
taking part (alive, silent: a cut link looks so) and blocked receiving from it is free within
seconds of aborting its communicator, as syncd's Abort does (`MemberAgent` closes every group),
instead of at the stall timeout."""

from __future__ import annotations

import datetime
import os
import threading

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from syncd.net import free_port

pytestmark = pytest.mark.gpu(count=2)

_WAIT_S = 120.0  # far beyond the 5 s the abort is given: only the abort can end the waits


def _ended_by(handle, what: str, ended: dict[str, BaseException]) -> None:
    try:
        handle.wait(_WAIT_S)
    except BaseException as e:  # noqa: BLE001 - the worker reads it
        ended[what] = e


def _blocked_member(transport, device: torch.device) -> str:
    """Rank 0: a send nobody takes and a receive nothing fills, then the abort."""
    from syncd.member.dataplane import TransferError, TransferTimeout

    ended: dict[str, BaseException] = {}
    # Large enough to block: NCCL finishes a 64 MiB send with nobody receiving (2x H200, measured),
    # buffered in the peer's memory; 512 MiB waits for the receiver.
    sending = transport.isend(torch.zeros(1 << 30, dtype=torch.uint8, device=device), 1)
    receiving = transport.irecv(torch.zeros(1 << 20, dtype=torch.uint8, device=device), 1)
    waits = [
        threading.Thread(target=_ended_by, args=(handle, what, ended))
        for what, handle in (("send", sending), ("receive", receiving))
    ]
    for t in waits:
        t.start()
    transport.abort()
    for t in waits:
        t.join(5)
    if any(t.is_alive() for t in waits):
        return "ok=False a transfer outlived the abort by 5 s"
    wrong = {
        what: repr(e)
        for what, e in ended.items()
        if not isinstance(e, TransferError) or isinstance(e, TransferTimeout)
    }
    return f"ok={sorted(ended) == ['receive', 'send'] and not wrong} ended={sorted(ended)} wrong={wrong}"


def _worker(rank: int, port: int, result_dir: str) -> None:
    from syncd.member.dataplane.nccl import NcclTransport

    torch.cuda.set_device(rank)
    device = torch.device(f"cuda:{rank}")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )
    box = [NcclTransport.create_address() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    transport = NcclTransport.connect(box[0], rank, 2, device, timeout_s=60)
    # Mid-refit: both directions connected and used once before the peer falls silent.
    out, back = (
        torch.ones(16, dtype=torch.uint8, device=device),
        torch.zeros(16, dtype=torch.uint8, device=device),
    )
    first, second = (transport.isend, transport.irecv) if rank == 0 else (transport.irecv, transport.isend)
    first(out if rank == 0 else back, 1 - rank).wait(60)
    second(back if rank == 0 else out, 1 - rank).wait(60)
    if rank == 0:
        result = _blocked_member(transport, device)
        with open(os.path.join(result_dir, "result.txt"), "w") as f:
            f.write(result + "\n")
    dist.barrier()  # the silent peer stays alive until the blocked member is done
    transport.abort()
    dist.destroy_process_group()


def test_an_abort_ends_a_blocked_nccl_send_and_receive_at_once(tmp_path):
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    result = (tmp_path / "result.txt").read_text()
    assert result.startswith("ok=True"), result
