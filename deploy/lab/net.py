"""The Linux commands a lab is made of: `ip` (namespaces, veth pairs, a bridge, addresses), `tc`
(token-bucket shaping) and `nsenter` (processes inside a namespace), run as the user would.

Nothing here keeps state; `deploy.lab.lab` decides names and order. Every failing command raises
`LabError` with the command line and what it printed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

NETNS_DIR = Path("/run/netns")  # where `ip netns add` mounts a namespace under its name

# Which Debian package brings each tool (named in the refusal; nothing is installed silently).
TOOL_PACKAGES = {"ip": "iproute2", "tc": "iproute2", "nsenter": "util-linux"}

# Token-bucket settings per shaped direction. The bucket must hold a few ms of traffic at the
# rate (a veth passes 64 KiB GSO segments, and TCP sends in bursts of them): with less, tbf
# drops what overflows and TCP backs off below the rate. `latency` bounds the queue behind the
# bucket. With these, one TCP stream carries 0.94-0.96 of the nominal rate in payload at
# 0.1-2 Gbit/s (headers are the other ~4 %; measured 2026-11-25 by a probe since deleted,
# `bench/lab_link.py` in git history).
BURST_SECONDS = 0.004
MIN_BURST_BYTES = 256 * 1024
QUEUE_LATENCY_MS = 50


class LabError(RuntimeError):
    """A lab could not be made, changed or removed; the message names the command or the cause."""


class LabUnavailableError(LabError):
    """This machine or user cannot run a lab (not root, or a tool is missing)."""


def missing_requirements() -> list[str]:
    """Why a lab cannot run here (empty when it can): not root, or `ip`/`tc`/`nsenter` missing,
    each with the Debian package that provides it."""
    problems = []
    if os.geteuid() != 0:
        problems.append(f"a lab needs root (network namespaces, veth, tc); running as uid {os.geteuid()}")
    for tool, package in TOOL_PACKAGES.items():
        if shutil.which(tool) is None:
            problems.append(
                f"`{tool}` not found on PATH (Debian package {package}: apt-get install {package})"
            )
    return problems


def require_tools() -> None:
    problems = missing_requirements()
    if problems:
        raise LabUnavailableError("cannot run a lab: " + "; ".join(problems))


def run(argv: Sequence[str], *, check: bool = True, timeout_s: float = 30) -> str:
    """Run one command; its stdout. A failure raises LabError naming the command and its stderr."""
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s)
    if check and result.returncode:
        raise LabError(f"`{' '.join(argv)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result.stdout


def ip(*args: str, netns: str | None = None, check: bool = True) -> str:
    return run(["ip", *(("-n", netns) if netns else ()), *args], check=check)


def tc(*args: str, netns: str | None = None) -> str:
    return run(["tc", *(("-n", netns) if netns else ()), *args])


def namespaces() -> list[str]:
    """Names of every named network namespace on this machine."""
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def add_namespace(netns: str) -> None:
    ip("netns", "add", netns)
    ip("link", "set", "lo", "up", netns=netns)  # services talk to themselves over loopback
    # IPv4 only: no IPv6 link-local chatter (router solicitations) in the byte counters.
    # /proc/sys/net shows the namespace of the process that opens it, hence nsenter.
    for scope in ("all", "default"):
        knob = f"/proc/sys/net/ipv6/conf/{scope}/disable_ipv6"
        run(nsenter_argv(netns, ["sh", "-c", f"echo 1 > {knob}"]))


def delete_namespace(netns: str) -> None:
    """Delete a namespace (its interfaces go with it, and with them their veth peers)."""
    ip("netns", "delete", netns, check=False)


def namespace_pids(netns: str) -> list[int]:
    """Processes whose network namespace is `netns` (what `ip netns pids` finds)."""
    if not (NETNS_DIR / netns).exists():
        return []
    return [int(p) for p in ip("netns", "pids", netns, check=False).split()]


def link_exists(ifname: str, netns: str | None = None) -> bool:
    return bool(ip("-o", "link", "show", "dev", ifname, netns=netns, check=False).strip())


def shape(ifname: str, netns: str | None, rate_gbit: float) -> None:
    """Shape what `ifname` sends to `rate_gbit` with a token bucket (`tc qdisc replace`, so it
    also changes an existing rate)."""
    rate_bytes_per_s = rate_gbit * 1e9 / 8
    burst = max(int(rate_bytes_per_s * BURST_SECONDS), MIN_BURST_BYTES)
    tc(
        "qdisc",
        "replace",
        "dev",
        ifname,
        "root",
        "tbf",
        "rate",
        f"{round(rate_gbit * 1e6)}kbit",
        "burst",
        str(burst),
        "latency",
        f"{QUEUE_LATENCY_MS}ms",
        netns=netns,
    )


def qdisc(ifname: str, netns: str | None) -> str:
    """What `tc qdisc show dev ifname` prints."""
    return tc("qdisc", "show", "dev", ifname, netns=netns).strip()


def link_stats(ifname: str, netns: str | None) -> dict:
    """The interface's counters (`ip -s -j link`'s `stats64`: rx/tx bytes, packets, drops)."""
    out = json.loads(ip("-s", "-j", "link", "show", "dev", ifname, netns=netns))
    return out[0]["stats64"]


def set_link(ifname: str, netns: str | None, up: bool) -> None:
    ip("link", "set", "dev", ifname, "up" if up else "down", netns=netns)


def nsenter_argv(netns: str, argv: Sequence[str]) -> list[str]:
    """`argv` run inside `netns`. `nsenter --net` changes only the network namespace, so the
    process keeps this machine's /sys and cgroups (`ip netns exec` remounts /sys)."""
    return ["nsenter", f"--net={NETNS_DIR / netns}", "--", *argv]
