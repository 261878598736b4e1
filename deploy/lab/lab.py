"""A lab of hosts on one machine: one network namespace per host, one bridge, shaped links.

    with Lab(["trainer", "syncd", "gen0", "gen1"], rate_gbit=1.0) as lab:
        token = lab.cluster.make_token(workdir)  # syncd on a lab address needs one; all get its file
        proc = lab.spawn("syncd", [sys.executable, "-m", "syncd", "--host", lab.address("syncd")])
        lab.link_down("gen1"); lab.link_up("gen1"); lab.set_rate("gen0", 0.1)
        sent = lab.tx_bytes("trainer")

Layout of a lab named NAME (all of it in the lab's own private /24, default the first free
10.77.N.0/24; nothing routes anywhere else):

- host H: namespace `wsl-NAME-H`, loopback up, one interface `eth0` with the address `.1`, `.2`,
  ... in the order the hosts were given;
- the switch: namespace `wsl-NAME.sw` with bridge `br0`; each host's `eth0` is a veth whose peer
  `p.H` is a bridge port. Each direction is shaped with `tc tbf` at the host's rate: `eth0`'s
  egress is what the host sends, `p.H`'s egress what it receives;
- this machine's own namespace reaches the lab through the veth `wsl-NAME` (address `.254`,
  unshaped), so a driver (the demo, a test) talks to the services over HTTP without entering.

Lifecycle: `up()` (or `with`) makes it; `down()` stops what the lab started, kills whatever else
still runs in its namespaces, and deletes them (their interfaces go with them). `with` also runs
`down()` on Ctrl-C and, in the main thread, on SIGTERM. A lab whose owner died (SIGKILL, a crash)
is removed by the next `up()` of any lab; `python -m deploy.lab up` makes a persistent lab that
stays until `down`. A record per lab in /run/weightsync-lab/NAME.json says who owns it.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import logging
import os
import re
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from deploy.lab import net
from deploy.local.processes import Cluster, Proc

log = logging.getLogger("lab")

STATE_DIR = Path("/run/weightsync-lab")
NS_PREFIX = "wsl-"  # every namespace of every lab starts with it (stale-lab cleanup looks for it)
DEFAULT_NAME = "wslab"
LAB_NAME = re.compile(r"[a-z][a-z0-9]{0,10}")  # + "wsl-" is the root-side interface (<= 15 chars)
HOST_NAME = re.compile(r"[a-z][a-z0-9-]{0,12}")  # + "p." is the switch port (<= 15 chars)
HOST_IFNAME = "eth0"
BRIDGE = "br0"
GATEWAY_PORT = "gw.sw"  # the switch side of the root namespace's veth ("." is not in host names)
GATEWAY_OCTET = 254
SUBNET_POOL = ipaddress.ip_network("10.77.0.0/16")  # default subnets: its /24s, first free


@dataclass(frozen=True)
class LabRecord:
    """What /run/weightsync-lab/NAME.json holds: enough to find and remove a lab from any process."""

    name: str
    subnet: str
    hosts: tuple[str, ...]
    rate_gbit: float
    owner_pid: int | None  # None: persistent (made by the CLI), removed only by `down`
    owner_start: int | None  # the owner's start time (/proc/PID/stat), against pid reuse

    def owner_alive(self) -> bool:
        return self.owner_pid is None or _start_time(self.owner_pid) == self.owner_start


def _start_time(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def host_namespace(lab: str, host: str) -> str:
    return f"{NS_PREFIX}{lab}-{host}"


def switch_namespace(lab: str) -> str:
    return f"{NS_PREFIX}{lab}.sw"


def gateway_ifname(lab: str) -> str:
    return f"{NS_PREFIX}{lab}"


def _lab_of_namespace(netns: str) -> str:
    rest = netns[len(NS_PREFIX) :]
    return re.split(r"[-.]", rest, maxsplit=1)[0]


@contextlib.contextmanager
def _state_lock() -> Iterator[None]:
    """Serializes making and removing labs across processes (two test runs, a benchmark)."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def read_record(name: str) -> LabRecord | None:
    try:
        raw = json.loads((STATE_DIR / f"{name}.json").read_text())
    except FileNotFoundError:
        return None
    return LabRecord(**{**raw, "hosts": tuple(raw["hosts"])})


def records() -> list[LabRecord]:
    found = []
    for path in sorted(STATE_DIR.glob("*.json")) if STATE_DIR.exists() else []:
        record = read_record(path.stem)
        if record is not None:
            found.append(record)
    return found


def _remove(name: str, hosts: Sequence[str] = ()) -> None:
    """Remove every trace of lab `name`: processes in its namespaces, its namespaces (found by
    prefix, so also a half-made lab), the root-side veth, the record. Caller holds the lock."""
    ours = [ns for ns in net.namespaces() if ns.startswith(NS_PREFIX) and _lab_of_namespace(ns) == name]
    ours += [host_namespace(name, h) for h in hosts if host_namespace(name, h) not in ours]
    _kill_namespace_processes(ours)
    if net.link_exists(gateway_ifname(name)):
        net.ip("link", "delete", gateway_ifname(name), check=False)
    for netns in ours:
        net.delete_namespace(netns)
    (STATE_DIR / f"{name}.json").unlink(missing_ok=True)


def _kill_namespace_processes(netnses: Sequence[str], grace_s: float = 10.0) -> None:
    """SIGTERM every process inside the lab's namespaces, SIGKILL what is left after `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [pid for ns in netnses for pid in net.namespace_pids(ns)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            pids = [pid for pid in pids if _start_time(pid) is not None and not _zombie(pid)]
            time.sleep(0.1)
        if not pids:
            return


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def remove_stale() -> list[str]:
    """Remove labs whose owner process is gone, and namespaces of labs without a record (a run
    killed before it wrote one). Returns the names removed. Caller holds the lock."""
    removed = []
    recorded = {r.name: r for r in records()}
    for record in recorded.values():
        if not record.owner_alive():
            _remove(record.name, record.hosts)
            removed.append(record.name)
    orphans = {_lab_of_namespace(ns) for ns in net.namespaces() if ns.startswith(NS_PREFIX)} - set(recorded)
    for name in sorted(orphans):
        _remove(name)
        removed.append(name)
    return removed


def remove(name: str) -> bool:
    """Remove lab `name` whoever owns it (`python -m deploy.lab down`); False if there was none."""
    net.require_tools()
    with _state_lock():
        existed = read_record(name) is not None or any(
            _lab_of_namespace(ns) == name for ns in net.namespaces() if ns.startswith(NS_PREFIX)
        )
        _remove(name)
    return existed


def _free_subnet() -> str:
    """The first /24 of SUBNET_POOL that no lab record and no route of this namespace uses."""
    taken = {r.subnet for r in records()}
    routes = net.ip("-4", "route", "show")
    for subnet in SUBNET_POOL.subnets(new_prefix=24):
        if str(subnet) not in taken and str(subnet) not in routes:
            return str(subnet)
    raise net.LabError(f"no free /24 left in {SUBNET_POOL} for a lab")


class Lab:
    """Hosts as network namespaces on one bridge; see the module docstring."""

    def __init__(
        self,
        hosts: Sequence[str],
        *,
        rate_gbit: float = 1.0,
        name: str = DEFAULT_NAME,
        subnet: str | None = None,
        logs: Path | str | None = None,
        persistent: bool = False,
    ) -> None:
        if not LAB_NAME.fullmatch(name):
            raise ValueError(f"lab name {name!r} must match {LAB_NAME.pattern}")
        for host in hosts:
            if not HOST_NAME.fullmatch(host):
                raise ValueError(f"host name {host!r} must match {HOST_NAME.pattern}")
        if len(set(hosts)) != len(hosts) or not hosts:
            raise ValueError(f"hosts must be distinct and at least one, got {list(hosts)}")
        if len(hosts) >= GATEWAY_OCTET:
            raise ValueError(f"a lab holds at most {GATEWAY_OCTET - 1} hosts, got {len(hosts)}")
        if not rate_gbit > 0:
            raise ValueError(f"rate_gbit must be > 0, got {rate_gbit}")
        if subnet is not None and ipaddress.ip_network(subnet).prefixlen != 24:
            raise ValueError(f"subnet must be a /24, got {subnet!r}")
        self.name, self.hosts, self.persistent = name, tuple(hosts), persistent
        self._rate = dict.fromkeys(self.hosts, rate_gbit)
        self._subnet = subnet
        self.cluster = Cluster(
            Path(logs) if logs else Path(tempfile.gettempdir()) / f"lab-{name}-{os.getpid()}"
        )
        self._previous_sigterm: signal.Handlers | Callable | int | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    def up(self) -> Lab:
        net.require_tools()
        with _state_lock():
            for stale in remove_stale():
                log.warning("removed stale lab %r (its owner is gone)", stale)
            existing = read_record(self.name)
            if existing is not None:
                owner = "persistent" if existing.owner_pid is None else f"owned by pid {existing.owner_pid}"
                raise net.LabError(
                    f"lab {self.name!r} already exists ({owner}); `python -m deploy.lab down --name "
                    f"{self.name}` removes it, or pick another name"
                )
            self._subnet = self._subnet or _free_subnet()
            self._write_record()  # first: a crash from here on leaves a lab the next up() removes
            try:
                self._build()
            except BaseException:
                _remove(self.name, self.hosts)
                raise
        log.info("lab %s up: %s", self.name, ", ".join(f"{h}={self.address(h)}" for h in self.hosts))
        return self

    def _write_record(self) -> None:
        pid = None if self.persistent else os.getpid()
        record = LabRecord(
            self.name,
            str(self._subnet),
            self.hosts,
            next(iter(self._rate.values())),
            pid,
            None if pid is None else _start_time(pid),
        )
        (STATE_DIR / f"{self.name}.json").write_text(json.dumps(asdict(record)) + "\n")

    def _build(self) -> None:
        switch = switch_namespace(self.name)
        net.add_namespace(switch)
        net.ip("link", "add", BRIDGE, "type", "bridge", netns=switch)
        net.ip("link", "set", BRIDGE, "up", netns=switch)
        prefix = self.subnet.prefixlen
        for host in self.hosts:
            netns = host_namespace(self.name, host)
            net.add_namespace(netns)
            port = f"p.{host}"
            net.ip(
                "link",
                "add",
                "name",
                HOST_IFNAME,
                "netns",
                netns,
                "type",
                "veth",
                "peer",
                "name",
                port,
                "netns",
                switch,
            )
            net.ip("link", "set", port, "master", BRIDGE, "up", netns=switch)
            net.ip("addr", "add", f"{self.address(host)}/{prefix}", "dev", HOST_IFNAME, netns=netns)
            net.ip("link", "set", HOST_IFNAME, "up", netns=netns)
            self._shape(host, self._rate[host])
        gateway = gateway_ifname(self.name)
        net.ip("link", "add", gateway, "type", "veth", "peer", "name", GATEWAY_PORT, "netns", switch)
        net.ip("link", "set", GATEWAY_PORT, "master", BRIDGE, "up", netns=switch)
        net.ip("addr", "add", f"{self.gateway}/{prefix}", "dev", gateway)
        net.ip("link", "set", gateway, "up")

    def down(self) -> None:
        """Stop the lab's processes (newest first), then remove everything the lab made."""
        self.cluster.stop()
        with _state_lock():
            _remove(self.name, self.hosts)
        log.info("lab %s down", self.name)

    def __enter__(self) -> Lab:
        self.up()
        if threading.current_thread() is threading.main_thread():
            # SIGTERM's default kills without unwinding; make it unwind through __exit__.
            self._previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.down()
        finally:
            if self._previous_sigterm is not None:
                signal.signal(signal.SIGTERM, self._previous_sigterm)
                self._previous_sigterm = None

    @classmethod
    def attach(cls, name: str = DEFAULT_NAME) -> Lab:
        """A handle on an existing lab (made by another process, e.g. `python -m deploy.lab up`),
        to run commands on its hosts or read its counters; its `down()` removes it."""
        record = read_record(name)
        if record is None:
            raise net.LabError(f"no lab named {name!r} (labs: {[r.name for r in records()] or 'none'})")
        lab = cls(record.hosts, rate_gbit=record.rate_gbit, name=name, subnet=record.subnet)
        lab.persistent = record.owner_pid is None
        return lab

    # ---- addresses and processes -----------------------------------------------------------

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        if self._subnet is None:
            raise net.LabError(f"lab {self.name!r} is not up: no subnet chosen yet")
        return ipaddress.IPv4Network(self._subnet)

    def address(self, host: str) -> str:
        """The host's address on the lab's network."""
        return str(self.subnet.network_address + 1 + self._index(host))

    @property
    def gateway(self) -> str:
        """This machine's own (root namespace) address on the lab's network, unshaped."""
        return str(self.subnet.network_address + GATEWAY_OCTET)

    def netns(self, host: str) -> str:
        self._index(host)
        return host_namespace(self.name, host)

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """`argv` to run inside `host` (for callers that start processes themselves)."""
        return net.nsenter_argv(self.netns(host), argv)

    def spawn(
        self, host: str, argv: Sequence[str], *, env: dict[str, str] | None = None, name: str = ""
    ) -> Proc:
        """Start `argv` inside `host` in its own session, output to `<logs>/<name>.log` (name
        defaults to the host); `down()` stops it. `env` adds to this process's environment."""
        return self.cluster.start(name or host, self.command(host, argv), env=env)

    # ---- the links -------------------------------------------------------------------------

    def _shape(self, host: str, rate_gbit: float) -> None:
        net.shape(HOST_IFNAME, self.netns(host), rate_gbit)  # what the host sends
        net.shape(f"p.{host}", switch_namespace(self.name), rate_gbit)  # what it receives

    def set_rate(self, host: str, rate_gbit: float) -> None:
        """Shape the host's link to `rate_gbit`, both directions."""
        if not rate_gbit > 0:
            raise ValueError(f"rate_gbit must be > 0, got {rate_gbit}")
        self._shape(host, rate_gbit)
        self._rate[host] = rate_gbit

    def rate_gbit(self, host: str) -> float:
        self._index(host)
        return self._rate[host]

    def qdiscs(self, host: str) -> dict[str, str]:
        """`tc qdisc show` of both ends of the host's link: {"egress": ..., "ingress": ...}."""
        return {
            "egress": net.qdisc(HOST_IFNAME, self.netns(host)),
            "ingress": net.qdisc(f"p.{host}", switch_namespace(self.name)),
        }

    def link_down(self, host: str) -> None:
        """Pull the host's cable: its switch port goes down (the host's eth0 loses carrier)."""
        self._index(host)
        net.set_link(f"p.{host}", switch_namespace(self.name), up=False)

    def link_up(self, host: str) -> None:
        self._index(host)
        net.set_link(f"p.{host}", switch_namespace(self.name), up=True)

    def tx_bytes(self, host: str) -> int:
        """Bytes the host's eth0 has sent since the lab came up (its egress)."""
        return int(net.link_stats(HOST_IFNAME, self.netns(host))["tx"]["bytes"])

    def rx_bytes(self, host: str) -> int:
        """Bytes the host's eth0 has received since the lab came up."""
        return int(net.link_stats(HOST_IFNAME, self.netns(host))["rx"]["bytes"])

    def _index(self, host: str) -> int:
        try:
            return self.hosts.index(host)
        except ValueError:
            raise ValueError(f"no host {host!r} in lab {self.name!r} (hosts: {list(self.hosts)})") from None


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)
