"""`python -m deploy.lab`: bring a lab of hosts up and down, run a command on a host, look at it.

    python -m deploy.lab up trainer syncd gen0 gen1 [--rate-gbit 1] [--name wslab] [--subnet S]
    python -m deploy.lab exec gen0 -- python -c 'import socket; print(socket.gethostname())'
    python -m deploy.lab status [--json]
    python -m deploy.lab link gen1 down|up
    python -m deploy.lab rate gen0 0.5
    python -m deploy.lab down

A lab made by `up` stays until `down` (other commands find it by `--name`). Needs root and
`ip`/`tc` (iproute2) and `nsenter` (util-linux); it refuses, naming what is missing, otherwise.
Exit status: 0 done, 1 a lab operation failed, 2 this machine cannot run a lab.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from deploy.lab import net
from deploy.lab.lab import DEFAULT_NAME, Lab, records, remove


def _status(name: str | None) -> list[dict]:
    rows = []
    for record in records():
        if name and record.name != name:
            continue
        lab = Lab.attach(record.name)
        hosts = [
            {
                "host": host,
                "address": lab.address(host),
                "netns": lab.netns(host),
                "qdisc": lab.qdiscs(host),
                "tx_bytes": lab.tx_bytes(host),
                "rx_bytes": lab.rx_bytes(host),
            }
            for host in lab.hosts
        ]
        owner = "persistent" if record.owner_pid is None else f"pid {record.owner_pid}"
        alive = record.owner_alive()
        rows.append(
            {"name": record.name, "subnet": record.subnet, "gateway": lab.gateway, "owner": owner}
            | {"owner_alive": alive, "hosts": hosts}
        )
    return rows


def _print_status(rows: list[dict]) -> None:
    if not rows:
        print("no lab is up")
    for row in rows:
        stale = "" if row["owner_alive"] else " (owner gone: stale, the next `up` removes it)"
        print(f"lab {row['name']}: {row['subnet']}, this machine at {row['gateway']}, {row['owner']}{stale}")
        print(f"  {'host':<14} {'address':<15} {'tx bytes':>14} {'rx bytes':>14}  shaping (egress)")
        for h in row["hosts"]:
            shaping = h["qdisc"]["egress"].split(" root ")[-1]
            print(f"  {h['host']:<14} {h['address']:<15} {h['tx_bytes']:>14} {h['rx_bytes']:>14}  {shaping}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.lab", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--name", help=f"the lab's name (default {DEFAULT_NAME}; `status` shows every lab without it)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="make a persistent lab of HOSTS")
    up.add_argument("hosts", nargs="+", help="host names, e.g. trainer syncd gen0 gen1")
    up.add_argument("--rate-gbit", type=float, default=1.0, help="every link's rate, both ways")
    up.add_argument("--subnet", help="the lab's /24 (default: the first free 10.77.N.0/24)")
    sub.add_parser("down", help="remove the lab and every process in it")
    ex = sub.add_parser("exec", help="run a command inside a host (after --)")
    ex.add_argument("host")
    ex.add_argument("argv", nargs=argparse.REMAINDER)
    st = sub.add_parser("status", help="the labs, their hosts, addresses, shaping and byte counters")
    st.add_argument("--json", action="store_true")
    link = sub.add_parser("link", help="set a host's link down (cable pulled) or up")
    link.add_argument("host")
    link.add_argument("state", choices=("up", "down"))
    rate = sub.add_parser("rate", help="shape a host's link to GBIT, both ways")
    rate.add_argument("host")
    rate.add_argument("gbit", type=float)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        net.require_tools()
        return _run(args)
    except net.LabUnavailableError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (net.LabError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _run(args) -> int:
    if args.command == "status":
        rows = _status(args.name)
        print(json.dumps(rows, indent=2)) if args.json else _print_status(rows)
        return 0
    args.name = args.name or DEFAULT_NAME
    if args.command == "up":
        lab = Lab(args.hosts, rate_gbit=args.rate_gbit, name=args.name, subnet=args.subnet, persistent=True)
        lab.up()
        for host in lab.hosts:
            print(f"{host} {lab.address(host)}")
    elif args.command == "down":
        print(f"lab {args.name} removed" if remove(args.name) else f"no lab {args.name} was up")
    elif args.command == "exec":
        argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        if not argv:
            raise ValueError("exec needs a command after the host: exec HOST -- CMD ...")
        command = Lab.attach(args.name).command(args.host, argv)
        os.execvp(command[0], command)  # the command's exit status is ours
    elif args.command == "link":
        lab = Lab.attach(args.name)
        (lab.link_up if args.state == "up" else lab.link_down)(args.host)
    elif args.command == "rate":
        Lab.attach(args.name).set_rate(args.host, args.gbit)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
