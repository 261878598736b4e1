"""The lab of hosts (`deploy.lab`) made for real: namespaces, a bridge, veths shaped with tc, and
processes inside. No timing assertions: how fast a shaped link is was measured once
(`bench/lab_link.py`, 2026-11-25, in git history)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deploy.lab import Lab, LabError, net
from deploy.lab.lab import STATE_DIR, gateway_ifname
from tests.lab_support import lab_name, require_lab, running_lab
from tests.polling import wait_until
from tests.terminal_signals import signals_as_in_a_terminal

PY = sys.executable
REPO = Path(__file__).resolve().parents[2]

# A TCP server that answers every connection with its own address, then the bytes it received.
ECHO_SERVER = textwrap.dedent(
    """
    import socket, sys
    with socket.create_server((sys.argv[1], int(sys.argv[2]))) as server:
        while True:
            conn, _ = server.accept()
            with conn:
                received = 0
                while chunk := conn.recv(1 << 16):
                    received += len(chunk)
                conn.sendall(f"{sys.argv[1]} {received}".encode())
    """
)
# Connects (retrying while the server starts), sends N bytes, prints the answer.
CLIENT = textwrap.dedent(
    """
    import socket, sys, time
    deadline = time.monotonic() + float(sys.argv[4])
    while True:
        try:
            conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with conn:
        conn.sendall(bytes(int(sys.argv[3])))
        conn.shutdown(socket.SHUT_WR)
        print(conn.recv(100).decode())
    """
)
PORT = 7300


def client(lab: Lab | None, host: str | None, address: str, nbytes: int = 10, timeout_s: float = 20):
    """Run CLIENT inside `host` (or in this machine's namespace when `lab` is None)."""
    argv = [PY, "-c", CLIENT, address, str(PORT), str(nbytes), str(timeout_s)]
    if lab is not None:
        argv = lab.command(host, argv)
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s + 30)


def lab_leftovers(name: str) -> list[str]:
    """Namespaces, root-side links and records of lab `name` that still exist."""
    left = [ns for ns in net.namespaces() if ns.startswith(f"wsl-{name}-") or ns == f"wsl-{name}.sw"]
    if net.link_exists(gateway_ifname(name)):
        left.append(f"link {gateway_ifname(name)}")
    if (STATE_DIR / f"{name}.json").exists():
        left.append("record")
    return left


@pytest.fixture
def lab(tmp_path):
    with running_lab(["a", "b", "c"], "t", tmp_path / "logs") as lab:
        yield lab


def test_hosts_reach_each_other_and_this_machine_reaches_them(lab):
    lab.spawn("a", [PY, "-c", ECHO_SERVER, lab.address("a"), str(PORT)])
    for host in ("b", "c"):
        result = client(lab, host, lab.address("a"), nbytes=1000)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == [lab.address("a"), "1000"]
    result = client(None, None, lab.address("a"))  # the driver's way in: the gateway veth
    assert result.returncode == 0, result.stderr
    assert len({lab.address(h) for h in lab.hosts} | {lab.gateway}) == 4


def test_each_host_has_its_own_loopback_and_no_route_out(lab):
    for host in lab.hosts:
        assert "UP" in net.ip("-o", "link", "show", "lo", netns=lab.netns(host))
        routes = net.ip("-4", "route", "show", netns=lab.netns(host))
        assert routes.split()[0] == str(lab.subnet) and "default" not in routes
    # A server on host a's loopback is not host b's loopback.
    lab.spawn("a", [PY, "-c", ECHO_SERVER, "127.0.0.1", str(PORT)])
    assert client(lab, "a", "127.0.0.1").stdout.split() == ["127.0.0.1", "10"]
    assert client(lab, "b", "127.0.0.1", timeout_s=1).returncode != 0


def test_links_are_shaped_both_ways_and_the_rate_changes(lab):
    for host in lab.hosts:
        shaping = lab.qdiscs(host)
        for direction in ("egress", "ingress"):
            assert "tbf" in shaping[direction] and "rate 1Gbit" in shaping[direction], shaping
    lab.set_rate("b", 0.25)
    assert all("rate 250Mbit" in q for q in lab.qdiscs("b").values()), lab.qdiscs("b")
    assert all("rate 1Gbit" in q for q in lab.qdiscs("a").values())
    assert lab.rate_gbit("b") == 0.25
    with pytest.raises(ValueError, match="rate_gbit must be > 0, got 0"):
        lab.set_rate("b", 0)


def test_link_down_makes_a_host_unreachable_until_it_is_up(lab):
    lab.spawn("a", [PY, "-c", ECHO_SERVER, lab.address("a"), str(PORT)])
    assert client(lab, "b", lab.address("a")).returncode == 0
    lab.link_down("a")
    cut = client(lab, "b", lab.address("a"), timeout_s=2)
    assert cut.returncode != 0 and ("timed out" in cut.stderr or "unreachable" in cut.stderr), cut.stderr
    lab.link_up("a")
    back = wait_until(
        lambda: client(lab, "b", lab.address("a"), timeout_s=5).returncode == 0, 30, "link back"
    )
    assert back


def test_byte_counters_count_what_a_host_sends_and_receives(lab):
    lab.spawn("a", [PY, "-c", ECHO_SERVER, lab.address("a"), str(PORT)])
    client(lab, "b", lab.address("a"), nbytes=1)  # server up, ARP resolved
    sent_before, received_before = lab.tx_bytes("b"), lab.rx_bytes("a")
    other_before = lab.rx_bytes("c")
    payload = 20_000_000
    assert client(lab, "b", lab.address("a"), nbytes=payload).returncode == 0
    sent, received = lab.tx_bytes("b") - sent_before, lab.rx_bytes("a") - received_before
    assert payload <= sent < payload * 1.1  # plus TCP/IP headers
    assert payload <= received < payload * 1.1
    assert lab.rx_bytes("c") - other_before < 100_000  # a bridge, not a hub: c saw none of it


def test_down_removes_everything_and_stops_every_process(tmp_path):
    require_lab()
    name = lab_name("d")
    with Lab(["x", "y"], name=name, logs=tmp_path) as lab:
        spawned = lab.spawn("x", ["sleep", "600"])
        # Started by someone else inside the lab, in its own session: the lab still stops it.
        other = subprocess.Popen(lab.command("y", ["sleep", "600"]), start_new_session=True)
        assert lab_leftovers(name)
    assert lab_leftovers(name) == []
    assert spawned.popen.poll() is not None
    assert other.wait(10) is not None


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_tears_the_lab_down(tmp_path, sig):
    require_lab()
    name = lab_name("s")
    script = textwrap.dedent(
        f"""
        import time
        from deploy.lab import Lab
        with Lab(["x"], name={name!r}, logs={str(tmp_path)!r}) as lab:
            lab.spawn("x", ["sleep", "600"])
            print("up", flush=True)
            time.sleep(600)
        """
    )
    with signals_as_in_a_terminal():  # as a command in a terminal has them (tests/terminal_signals.py)
        owner = subprocess.Popen([PY, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert owner.stdout.readline().strip() == "up"
    assert lab_leftovers(name)
    owner.send_signal(sig)
    assert owner.wait(60) != 0
    assert lab_leftovers(name) == []
    assert not net.namespace_pids(f"wsl-{name}-x")


def test_a_stale_lab_is_removed_by_the_next_up(tmp_path):
    require_lab()
    stale, fresh = lab_name("k"), lab_name("f")
    script = textwrap.dedent(
        f"""
        import time
        from deploy.lab import Lab
        lab = Lab(["x"], name={stale!r}, logs={str(tmp_path)!r}).up()
        print(lab.spawn("x", ["sleep", "600"]).popen.pid, flush=True)
        time.sleep(600)
        """
    )
    owner = subprocess.Popen([PY, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    sleeper = int(owner.stdout.readline())
    owner.kill()  # SIGKILL: nothing of the lab runs its cleanup
    owner.wait(10)
    assert lab_leftovers(stale) and net.namespace_pids(f"wsl-{stale}-x") == [sleeper]
    with Lab(["y"], name=fresh, logs=tmp_path):
        assert lab_leftovers(stale) == []
    assert wait_until(lambda: not os.path.exists(f"/proc/{sleeper}") or _zombie(sleeper), 10, "sleeper gone")


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_live_lab_of_the_same_name_is_refused(tmp_path):
    require_lab()
    name = lab_name("r")
    with Lab(["x"], name=name, logs=tmp_path):
        with pytest.raises(LabError, match=f"lab '{name}' already exists .*owned by pid {os.getpid()}"):
            Lab(["y"], name=name, logs=tmp_path).up()
        assert lab_leftovers(name)  # the refusal did not touch the live lab


def test_cli_up_exec_status_down(tmp_path):
    require_lab()
    name = lab_name("c")
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def cli(*args: str) -> subprocess.CompletedProcess:
        argv = [PY, "-m", "deploy.lab", "--name", name, *args]
        return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)

    try:
        up = cli("up", "gen0", "gen1", "--rate-gbit", "0.5")
        assert up.returncode == 0, up.stderr
        addresses = dict(line.split() for line in up.stdout.splitlines())
        assert list(addresses) == ["gen0", "gen1"]
        ran = cli("exec", "gen1", "--", "ip", "-o", "-4", "addr", "show", "eth0")
        assert ran.returncode == 0 and f"{addresses['gen1']}/24" in ran.stdout, ran
        assert cli("exec", "gen1", "--", "false").returncode == 1  # the command's own status
        status = json.loads(cli("status", "--json").stdout)
        assert [h["address"] for h in status[0]["hosts"]] == [addresses["gen0"], addresses["gen1"]]
        assert "rate 500Mbit" in status[0]["hosts"][0]["qdisc"]["ingress"]
        assert cli("link", "gen0", "down").returncode == 0
        assert "state DOWN" in net.ip("-o", "link", "show", "p.gen0", netns=f"wsl-{name}.sw")
    finally:
        down = cli("down")
    assert down.returncode == 0 and f"lab {name} removed" in down.stdout
    assert lab_leftovers(name) == []
    assert cli("exec", "gen0", "--", "true").returncode == 1  # no such lab any more


def test_cli_refuses_without_root_or_tools_naming_what_is_missing(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": str(tmp_path)}  # no ip, tc or nsenter
    argv = [PY, "-m", "deploy.lab", "up", "a"]
    result = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    for text in ("`ip` not found", "iproute2", "`nsenter` not found", "util-linux"):
        assert text in result.stderr
    if os.geteuid() == 0 and _others_can_read(REPO):  # (a checkout in a 0700 directory: they cannot)
        as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv]
        result = subprocess.run(
            as_nobody,
            cwd=REPO,
            env={**env, "PATH": os.environ["PATH"]},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2 and "a lab needs root" in result.stderr, result.stderr


def _others_can_read(path: Path) -> bool:
    """Whether a user other than the owner can import from `path` (read it, pass every parent)."""
    parents = [path, *path.parents]
    return bool(path.stat().st_mode & 0o004) and all(p.stat().st_mode & 0o001 for p in parents)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hosts": ["Gen0"]}, "host name 'Gen0' must match"),
        ({"hosts": ["a", "a"]}, "hosts must be distinct"),
        ({"hosts": ["a"], "name": "lab-1"}, "lab name 'lab-1' must match"),
        ({"hosts": ["a"], "subnet": "10.77.0.0/16"}, "subnet must be a /24"),
        ({"hosts": ["a"], "rate_gbit": -1}, "rate_gbit must be > 0"),
    ],
)
def test_bad_lab_settings_are_refused_by_name(kwargs, message):
    hosts = kwargs.pop("hosts")
    with pytest.raises(ValueError, match=message):
        Lab(hosts, **kwargs)
