"""One member of a CUDA IPC link for `test_cuda_ipc.py`, in its own process on GPU 0.

    python tests/gpu/ipc_peer.py ROLE MODE PORT

ROLE sender or receiver; MODE the scenario (`test_cuda_ipc.py` says what each checks). The
synthetic MoE of `testkit/colocated.py` at 0.25 GiB (trainer layout into vLLM's). Each process
writes its findings as JSON under the store key "result/ROLE".
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist

from syncd.layout.dtypes import torch_dtype
from syncd.member.dataplane import TransferError, catalog_views
from syncd.member.dataplane.cuda_ipc import IpcReceiver, IpcSender
from syncd.member.dataplane.local_channel import Channel, StoreChannel, socket_channel
from testkit.colocated import plan_units, source_tensors

GIB = 0.25
TIMEOUT_S = 5.0
WAIT_S = 60.0


def _free_device_bytes() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def sender(mode: str, channel: Channel, control: StoreChannel) -> dict:
    src_cat, _, units = plan_units(GIB)
    channel.take("receiver-ready", WAIT_S)
    own = source_tensors(GIB)
    ipc = IpcSender(catalog_views(src_cat, own))
    out: dict = {"weights": sum(t.nbytes for t in own.values())}
    if mode.startswith("sender-dies"):  # offers its memory, then is gone
        ipc.offer(units, channel, "r0")
        if mode == "sender-dies-after-mapping":
            channel.take("mapped", WAIT_S)
        os.kill(os.getpid(), signal.SIGKILL)
    sums = [ipc.send(units, channel, "r0", WAIT_S)]
    for tensor in own.values():  # new bits in the same memory: the receiver's kept mappings see them
        tensor.view(torch.uint8).add_(1)
    del tensor
    if mode == "receiver-dies":
        try:
            ipc.send(units, channel, "r1", TIMEOUT_S)
            out["error"] = None
        except TransferError as e:
            out["error"] = str(e)
    else:
        sums.append(ipc.send(units, channel, "r1", WAIT_S))
        channel.post("sums", json.dumps(sums).encode())
        channel.take("receiver-checked", WAIT_S)
    del own, ipc  # the weights go while the receiver (if alive) still maps them
    _free_device_bytes()
    out["allocated_after_freeing"] = torch.cuda.memory_allocated()
    if mode == "normal":
        channel.post("sender-freed", b"")
    return out


def receiver(mode: str, channel: Channel, control: StoreChannel) -> dict:
    _, dst_cat, units = plan_units(GIB)
    mine = {
        t.name: torch.full(t.shape, float("nan"), dtype=torch_dtype(t.dtype), device="cuda")
        for t in dst_cat.tensors
    }
    views = catalog_views(dst_cat, mine)
    ipc = IpcReceiver()
    channel.post("receiver-ready", b"")
    out: dict = {}
    if mode.startswith("sender-dies"):
        offer = channel.take("r0/ready", WAIT_S)
        if mode == "sender-dies-after-mapping":  # the sender goes while its memory is mapped here
            ipc.open(offer)
            channel.post("mapped", b"")
        control.take("sender-gone", WAIT_S)  # the test saw the sender's process end
        held = _free_device_bytes()
        try:
            ipc.open(offer)
            out["failed"] = None
        except TransferError as e:
            out["failed"] = str(e)
        ipc.close()
        out["freed_by_close"] = _free_device_bytes() - held
        out["gpu_works"] = torch.ones(4, device="cuda").sum().item() == 4  # no sticky CUDA error
        return out
    landed = [ipc.receive(units, views, channel, "r0", WAIT_S)]
    if mode == "receiver-dies":  # holds the sender's memory mapped, killed before "done" of r1
        channel.take("r1/ready", WAIT_S)
        os.kill(os.getpid(), signal.SIGKILL)
    landed.append(ipc.receive(units, views, channel, "r1", WAIT_S))
    expected = catalog_views(plan_units(GIB)[0], source_tensors(GIB))
    out["bit_exact"] = all(
        torch.equal(
            views[u.dst_tensor][u.dst_box.slices()].reshape(-1).view(torch.uint8),
            (expected[u.src_tensor][u.src_box.slices()].reshape(-1).view(torch.uint8) + 1),
        )
        for u in units
    )
    del expected
    sums = json.loads(channel.take("sums", WAIT_S))
    out["checksums_agree"] = sums == landed and len(landed[1]) == len(units)
    out["checksums_changed"] = landed[0] != landed[1]
    channel.post("receiver-checked", b"")
    channel.take("sender-freed", WAIT_S)  # its weights are freed, and still mapped here
    held = _free_device_bytes()
    ipc.close()
    out["freed_by_close"] = _free_device_bytes() - held
    return out


def main() -> None:
    role, mode, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=WAIT_S))
    channel = socket_channel(store, "ipc-channel", listen=role == "receiver", timeout_s=WAIT_S)
    result = (sender if role == "sender" else receiver)(mode, channel, StoreChannel(store, "test"))
    store.set(f"result/{role}", json.dumps(result))


if __name__ == "__main__":
    main()
