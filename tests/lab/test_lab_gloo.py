"""The data plane's gloo groups across lab hosts: each member's gloo sockets listen on the address it
reported (`GlooTransport.connect(..., bind_host=)`, what `MemberAgent` passes from `--data-host`).
Without it gloo advertises what the hostname resolves to (127.0.0.1 here), which the other host
cannot reach, and the group never forms."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.lab_support import running_lab

MEMBER = textwrap.dedent(
    """
    import sys, torch
    from syncd.member.dataplane import GlooTransport

    rank, me, store_host = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    if rank == 0:
        address, store = GlooTransport.create_address(me, 2, 60)
        print(address, flush=True)
    else:
        address, store = sys.stdin.readline().strip(), None
    transport = GlooTransport.connect(address, rank, 2, "lab", 60, store, bind_host=me)
    data = torch.arange(1 << 20, dtype=torch.int32)
    if rank == 0:
        transport.isend(data, 1).wait(60)
    else:
        got = torch.zeros_like(data)
        transport.irecv(got, 0).wait(60)
        print("equal" if torch.equal(got, data) else "DIFFERENT", flush=True)
    transport.close()
    """
)


def test_a_gloo_group_spans_two_lab_hosts(tmp_path):
    with running_lab(["t0", "g0"], "gl", tmp_path / "logs") as lab:
        sender = subprocess.Popen(
            lab.command("t0", [sys.executable, "-c", MEMBER, "0", lab.address("t0"), lab.address("t0")]),
            stdout=subprocess.PIPE,
            text=True,
        )
        address = sender.stdout.readline().strip()
        assert address.startswith(f"{lab.address('t0')}:"), address
        before = lab.tx_bytes("t0")
        receiver = subprocess.run(
            lab.command("g0", [sys.executable, "-c", MEMBER, "1", lab.address("g0"), lab.address("t0")]),
            input=address + "\n",
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert receiver.returncode == 0, receiver.stderr
        assert receiver.stdout.split() == ["equal"]
        assert sender.wait(60) == 0
        assert lab.tx_bytes("t0") - before >= 4 << 20  # the 4 MiB crossed the sender's link
