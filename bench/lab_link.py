"""What a lab link really carries: one TCP stream between two lab hosts, per shaped rate.

    python -m bench.lab_link [--rates 0.1,0.5,1,2] [--seconds 3] [--json FILE]

Needs root (it makes a lab of two hosts). For each rate the sender in host `a` writes 1 MiB
chunks to the receiver in host `b` for `--seconds`; the receiver reports bytes over the time from
its first to its last byte. Both links are shaped at the rate, so this measures what `tc tbf`
(with the lab's burst and queue settings, `deploy/lab/net.py`) lets a TCP stream through, plus an
unshaped reference (the veth and bridge alone on this machine's CPUs).
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import sys
import time

from deploy.lab import Lab

CHUNK = 1 << 20


def serve(address: str, port: int) -> None:
    """Receive one connection to the end; print `bytes seconds` (first to last byte)."""
    with socket.create_server((address, port)) as server:
        conn, _ = server.accept()
        buf = bytearray(CHUNK)
        total, first = 0, None
        with conn:
            while n := conn.recv_into(buf):
                first = first or time.monotonic()
                total += n
        print(total, time.monotonic() - (first or time.monotonic()), flush=True)


def send(address: str, port: int, seconds: float) -> None:
    payload = bytes(CHUNK)
    deadline = time.monotonic() + 30
    while True:
        try:
            conn = socket.create_connection((address, port), timeout=5)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with conn:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            conn.sendall(payload)


def measure(lab: Lab, seconds: float, port: int = 5201) -> float:
    """Gbit/s of one stream from host a to host b."""
    receiver = lab.spawn(
        "b", [sys.executable, "-m", "bench.lab_link", "--serve", lab.address("b"), str(port)]
    )
    sender = lab.spawn(
        "a", [sys.executable, "-m", "bench.lab_link", "--send", lab.address("b"), str(port), str(seconds)]
    )
    if sender.popen.wait(seconds + 60) or receiver.popen.wait(60):
        raise RuntimeError(f"measurement failed:\n{sender.tail()}\n{receiver.tail()}")
    total, elapsed = receiver.tail(1).split()
    return int(total) * 8 / float(elapsed) / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="0.1,0.5,1,2", help="Gbit/s, comma-separated")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--serve", nargs=2, metavar=("ADDRESS", "PORT"), help=argparse.SUPPRESS)
    parser.add_argument("--send", nargs=3, metavar=("ADDRESS", "PORT", "SECONDS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return 0
    if args.send:
        send(args.send[0], int(args.send[1]), float(args.send[2]))
        return 0
    rows = []
    with Lab(["a", "b"], name="linkbench") as lab:
        unshaped = 1000.0  # tbf at 1 Tbit/s: the bucket never empties
        for rate in [unshaped, *(float(r) for r in args.rates.split(","))]:
            lab.set_rate("a", rate)
            lab.set_rate("b", rate)
            got = measure(lab, args.seconds)
            label = "unshaped" if rate == unshaped else f"{rate:g}"
            ratio = "" if rate == unshaped else f"  {got / rate:.3f} of nominal"
            print(f"rate {label:>8} Gbit/s: one TCP stream {got:.3f} Gbit/s{ratio}", flush=True)
            rows.append({"rate_gbit": None if rate == unshaped else rate, "tcp_gbit": round(got, 4)})
    if args.json:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.node()}
        with open(args.json, "w") as f:
            json.dump({**meta, "seconds": args.seconds, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
