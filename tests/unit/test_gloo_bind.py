"""A gloo data-plane group can listen on the address its member reported (`bind_host`): torch's
private names it takes for that are pinned here, so an upgrade that renames them fails in one
place. Across hosts (network namespaces, where it matters) it runs in tests/lab/test_lab_gloo.py."""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from syncd.member.dataplane import GlooTransport


def test_torch_still_has_the_private_gloo_option_names_the_transport_uses():
    options = dist.ProcessGroupGloo._Options()
    assert hasattr(options, "_devices") and hasattr(options, "_timeout")
    device = dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
    options._devices = [device]
    assert len(options._devices) == 1


def test_a_group_bound_to_an_address_moves_bytes():
    address, store = GlooTransport.create_address("127.0.0.1", 2, 30)
    sent = torch.arange(1000, dtype=torch.uint8)
    received = torch.zeros(1000, dtype=torch.uint8)
    errors: list[BaseException] = []

    def member(rank: int) -> None:
        try:
            transport = GlooTransport.connect(
                address, rank, 2, "bound", 30, store if rank == 0 else None, bind_host="127.0.0.1"
            )
            if rank == 0:
                transport.isend(sent, 1).wait(30)
            else:
                transport.irecv(received, 0).wait(30)
            transport.close()
        except Exception as e:  # noqa: BLE001  # any failure is the test's: reported below, in its thread
            errors.append(e)

    threads = [threading.Thread(target=member, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert torch.equal(received, sent)
