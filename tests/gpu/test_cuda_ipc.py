"""One GPU, two processes: the CUDA IPC data plane (`syncd/member/dataplane/cuda_ipc.py`), its
lifetimes and its faults, with device memory watched through the driver (`mem_get_info`).

- Two refits, the second after the sender rewrote its weights in place (same memory: the
  receiver's kept mappings): every unit lands bit-exact and both sides' checksums agree; the
  sender then frees its weights, which the receiver's mappings keep on the device until its close
  gives them back.
- A receiver killed while it maps the sender's memory: the sender's refit fails within its
  timeout, and the sender's allocator holds nothing for it once it freed its weights (torch's own
  IPC sharing kept 96 MB of 100 then).
- A sender killed after its offer, before the receiver mapped it: the receiver fails with a clear
  error and its GPU context still works.
- A sender killed while the receiver maps its memory: the memory stays until the receiver
  closes, and its close gives it back to the device.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from syncd.net import free_port

pytestmark = pytest.mark.gpu(count=1)

PEER = Path(__file__).with_name("ipc_peer.py")
SLACK = 64 << 20  # a process's own small allocations, against 255 MB of weights


def _run(mode: str) -> tuple[dict, dict, list[int]]:
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    procs = {
        r: subprocess.Popen([sys.executable, str(PEER), r, mode, str(port)]) for r in ("sender", "receiver")
    }
    try:
        if mode.startswith("sender-dies"):
            procs["sender"].wait(timeout=120)
            store.set("test/sender-gone", b"")
        codes = [procs[r].wait(timeout=120) for r in ("sender", "receiver")]
    finally:
        for p in procs.values():
            p.kill()
    found = {r: json.loads(store.get(f"result/{r}")) if store.check([f"result/{r}"]) else {} for r in procs}
    return found["sender"], found["receiver"], codes


def test_two_refits_land_exactly_and_the_receivers_close_gives_the_memory_back():
    sender, receiver, codes = _run("normal")
    assert codes == [0, 0]
    assert receiver.pop("freed_by_close") > sender["weights"] - SLACK
    assert receiver == {"bit_exact": True, "checksums_agree": True, "checksums_changed": True}
    assert sender["allocated_after_freeing"] == 0


def test_a_receiver_killed_mid_refit_fails_the_senders_refit_and_holds_nothing():
    sender, _, codes = _run("receiver-dies")
    assert codes[0] == 0 and codes[1] != 0
    assert sender["error"] and "'r1/done'" in sender["error"]
    assert sender["allocated_after_freeing"] == 0


def test_a_sender_killed_before_the_receiver_maps_fails_the_receiver_cleanly():
    _, receiver, codes = _run("sender-dies")
    assert codes[0] != 0 and codes[1] == 0
    assert receiver["failed"] and receiver["failed"].startswith("cuda ipc: cannot open")
    assert receiver["gpu_works"]


def test_a_sender_killed_while_mapped_leaves_its_memory_until_the_receiver_closes():
    _, receiver, codes = _run("sender-dies-after-mapping")
    assert codes[0] != 0 and codes[1] == 0
    assert receiver["freed_by_close"] > 255e6 - SLACK  # the weights: 255 MB
    assert receiver["gpu_works"]
