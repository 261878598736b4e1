"""syncctl as an operator runs it (a subprocess) against a real syncd."""

from __future__ import annotations

import json
import signal
import subprocess
import threading

import pytest
from syncd_harness import PYTHON, REPO, TOKEN, Cluster

from syncd.commands import ExecutePlan
from syncd.net import free_port
from tests.terminal_signals import signals_as_in_a_terminal


def syncctl(url: str, *args: str, token: str | None = None) -> subprocess.CompletedProcess:
    cmd = [PYTHON, "-m", "syncd.cli", "--url", url, *(["--token", token] if token else []), *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)


def test_operator_session(make_cluster) -> None:
    cluster: Cluster = make_cluster(auth_token=TOKEN)
    cluster.start_all()
    cluster.announce(5)

    status = syncctl(cluster.url, "status")
    assert status.returncode == 0, status.stderr
    assert "IDLE" in status.stdout and "2/2 trainers" in status.stdout and "5" in status.stdout

    members = syncctl(cluster.url, "members")
    assert members.returncode == 0
    assert members.stdout.splitlines()[0].split()[:3] == ["MEMBER", "ROLE", "COORDS"]
    assert "generator-0-1  generator  replica=0,tp=1" in members.stdout

    plan = syncctl(cluster.url, "plan", "--json")
    assert plan.returncode == 0 and json.loads(plan.stdout)["total_bytes"] == 2 * 16 * 8 * 4 + 4 * 6 * 8 * 2
    assert "trainer-1" in syncctl(cluster.url, "plan").stdout

    denied = syncctl(cluster.url, "refit", "--wait")
    assert denied.returncode == 1 and "credentials" in denied.stderr and "Traceback" not in denied.stderr

    refit = syncctl(cluster.url, "refit", "--wait", token=TOKEN)
    assert refit.returncode == 0, refit.stderr
    assert "COMMITTED (weight version 5)" in refit.stdout
    # Progress shown while waiting (not a terminal: plain lines), each state it saw (a loaded
    # machine's first update may come after PREPARING, which lasts milliseconds here), the last
    # with every byte moved.
    shown = refit.stderr.strip().splitlines()
    assert shown[0].startswith("refit-1: ") and shown[-1].startswith("refit-1: COMMITTED  100.0%")
    refit_id = refit.stdout.split()[0]

    history = syncctl(cluster.url, "--json", "history")
    assert history.returncode == 0
    assert [r["id"] for r in json.loads(history.stdout)["refits"]] == [refit_id]
    assert refit_id in syncctl(cluster.url, "history").stdout

    finished = syncctl(cluster.url, "abort", refit_id, token=TOKEN)
    assert finished.returncode == 1 and "already finished as COMMITTED" in finished.stderr


def test_refit_wait_fails_when_the_refit_aborts(make_cluster) -> None:
    cluster: Cluster = make_cluster()
    cluster.start_all(**{"generator-0-0": {"corrupt": frozenset({"model.embed_tokens.weight"})}})
    cluster.announce(2)
    refit = syncctl(cluster.url, "refit", "--version", "2", "--wait")
    assert refit.returncode == 1
    assert "ABORTED" in refit.stderr and "model.embed_tokens.weight" in refit.stderr


def test_unreachable_syncd_is_one_line_and_nonzero() -> None:
    for args in (("status",), ("refit", "--wait"), ("members", "--json")):
        r = syncctl(f"http://127.0.0.1:{free_port()}", *args)
        assert r.returncode == 3
        assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1
        assert r.stderr.startswith("syncctl: cannot reach syncd at http://127.0.0.1:")


def test_watch_follows_a_refit_as_json_lines_and_ctrl_c_leaves_it_running(make_cluster) -> None:
    held = threading.Event()
    go_on = threading.Event()

    def hold(cmd: ExecutePlan) -> None:
        held.set()
        go_on.wait(120)

    # Held while two watchers start (each a Python process: seconds on a loaded machine), so
    # the transfer may take far longer than the harness's usual 20 s.
    cluster: Cluster = make_cluster(transfer_timeout=120.0)
    cluster.start_all(**{"generator-0-0": {"on_execute": hold}})
    cluster.announce(3)
    refit_id = cluster.refit()["id"]
    assert held.wait(30)
    with signals_as_in_a_terminal():  # Ctrl-C must reach it (tests/terminal_signals.py)
        watcher = subprocess.Popen(
            [PYTHON, "-m", "syncd.cli", "--url", cluster.url, "watch"],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    assert watcher.stdout is not None and watcher.stderr is not None
    line = watcher.stdout.readline()
    if not line:  # it ended: say why
        pytest.fail(f"watch ended ({watcher.wait()}) before a line: {watcher.stderr.read()[-3000:]}")
    assert line.startswith(f"{refit_id}: TRANSFERRING")  # the running refit
    watcher.send_signal(signal.SIGINT)
    _, err = watcher.communicate(timeout=30)
    assert watcher.returncode == 130 and f"stopped watching {refit_id}; the refit goes on" in err

    following = subprocess.Popen(
        [PYTHON, "-m", "syncd.cli", "--url", cluster.url, "watch", refit_id, "--json"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert following.stdout is not None
    first = following.stdout.readline()  # it follows the held refit before the refit goes on
    go_on.set()
    out, _ = following.communicate(timeout=60)
    assert following.returncode == 0
    updates = [json.loads(line) for line in [first, *out.splitlines()]]
    assert updates[0]["state"] == "TRANSFERRING" and updates[-1]["state"] == "COMMITTED"
    assert updates[-1]["progress"]["fraction"] == 1.0
    assert cluster.wait_refit(refit_id)["state"] == "COMMITTED"  # Ctrl-C stopped the watching only


def test_watch_fails_on_an_aborted_refit_and_an_unknown_one(make_cluster) -> None:
    cluster: Cluster = make_cluster()
    cluster.start_all(**{"generator-0-0": {"corrupt": frozenset({"model.embed_tokens.weight"})}})
    cluster.announce(2)
    refit_id = cluster.refit()["id"]
    watched = syncctl(cluster.url, "watch", refit_id)
    assert (
        watched.returncode == 1
        and "ABORTED" in watched.stdout
        and "model.embed_tokens.weight" in watched.stderr
    )
    unknown = syncctl(cluster.url, "watch", "refit-99")
    assert unknown.returncode == 1 and "refit-99" in unknown.stderr and "Traceback" not in unknown.stderr
