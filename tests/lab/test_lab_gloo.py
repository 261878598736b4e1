"""The data plane's gloo groups across lab hosts: each member's gloo sockets listen on the address it
reported (`GlooTransport.connect(..., bind_host=)`, what `MemberAgent` passes from `--data-host`).
Without it gloo advertises what the hostname resolves to (127.0.0.1 here), which the other host
cannot reach, and the group never forms."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.lab_support import running_lab
from tests.polling import wait_until

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


ABORTING_SENDER = textwrap.dedent(
    """
    import sys, threading, torch
    from syncd.member.dataplane import GlooTransport

    me = sys.argv[1]
    address, store = GlooTransport.create_address(me, 2, 60)
    print(address, flush=True)
    transport = GlooTransport.connect(address, 0, 2, "lab-abort", 60, store, bind_host=me)
    print("joined", flush=True)
    ended = []

    def send():
        try:
            transport.isend(torch.zeros(64 << 20, dtype=torch.uint8), 1).wait(120)
            ended.append("completed")
        except Exception as e:
            ended.append(f"{type(e).__name__}: {e}")

    sending = threading.Thread(target=send)
    sending.start()
    print("sending", flush=True)
    sys.stdin.readline()  # the receiver's link is down now
    transport.close()  # what the agent does with every group on syncd's Abort
    sending.join(5)
    print(ended[0] if ended else "still sending 5 s after the abort", flush=True)
    """
)

SLOW_RECEIVER = textwrap.dedent(
    """
    import sys, torch
    from syncd.member.dataplane import GlooTransport

    transport = GlooTransport.connect(sys.argv[2], 1, 2, "lab-abort", 60, bind_host=sys.argv[1])
    try:
        transport.irecv(torch.zeros(64 << 20, dtype=torch.uint8), 0).wait(120)
    except Exception:
        pass
    """
)


def test_an_abort_ends_a_send_in_flight_to_a_host_cut_off(tmp_path):
    """A send already on the wire to a host whose link went down (no reset) ends at the sender's
    abort, not at its timeout: gloo itself wakes no wait on a send in flight."""
    with running_lab(["t0", "g0"], "ga", tmp_path / "logs") as lab:
        lab.set_rate("g0", 0.002)  # the 64 MiB take minutes: the send is in flight when the link goes
        sender = subprocess.Popen(
            lab.command("t0", [sys.executable, "-c", ABORTING_SENDER, lab.address("t0")]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        receiver = None
        try:
            address = sender.stdout.readline().strip()
            receiver = subprocess.Popen(
                lab.command("g0", [sys.executable, "-c", SLOW_RECEIVER, lab.address("g0"), address])
            )
            assert sender.stdout.readline().strip() == "joined"
            assert sender.stdout.readline().strip() == "sending"
            wait_until(lambda: lab.rx_bytes("g0") > 64 << 10, 60, "bytes of the send to reach g0")
            lab.link_down("g0")
            sender.stdin.write("cut\n")
            sender.stdin.flush()
            outcome = sender.stdout.readline().strip()
            assert outcome.startswith("TransferError:") and "the group was aborted" in outcome, outcome
        finally:
            for proc in (sender, receiver):
                if proc is not None:
                    proc.kill()
                    proc.wait(30)
