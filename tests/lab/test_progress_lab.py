"""Watching a refit as it happens, over a link slow enough to watch: a trainer and a generator on
two lab hosts (`testkit/plain_member.py`, a 41 MiB model in 512 KiB buckets), each host's link
shaped to 25 Mbit/s by `tc tbf`, so a refit's transfer takes about 14 s.

`syncctl watch --json` follows one refit to its end: many updates, bytes rising to 100%, and at
the halfway point an ETA within a quarter of the time that was actually left. `syncctl refit
--wait` in a real terminal (tmux) draws bars that move."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deploy.local.processes import PYTHON, Cluster, Proc
from syncd.auth import ENV_TOKEN_FILE
from syncd.daemon.service import Daemon
from tests.lab.test_fanout_lab import LabFleet
from tests.lab_support import running_lab
from tests.syncd_settings import syncd_settings

REPO = Path(__file__).resolve().parents[2]
RATE_GBIT = 0.025
MODEL = ("--model", "moe", "--mib", "24")  # 41 MiB: the smallest `moe` (testkit.plain_member)


class SlowFleet(LabFleet):
    def member(self, *args: str, name: str) -> Proc:
        return super().member(*args, *MODEL, name=name)


@pytest.fixture(scope="module")
def slow_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlowFleet]:
    tmp = tmp_path_factory.mktemp("progress")
    hosts = {"trainer-0": "t0", "generator-0-0": "g0"}
    with running_lab(sorted(hosts.values()), "prog", tmp / "logs", rate_gbit=RATE_GBIT) as lab:
        token = lab.cluster.make_token(tmp)  # syncd serves the lab's network: members need it
        settings = syncd_settings(
            tmp,
            host="0.0.0.0",
            auth_token_file=lab.cluster.env[ENV_TOKEN_FILE],
            prepare_timeout=60,
            transfer_timeout=120,
            verify_timeout=60,
            commit_timeout=60,
            bucket_bytes=512 << 10,  # ~80 buckets: the bytes rise bucket by bucket
            expected_trainers=1,
            expected_generators=1,
        )
        daemon = Daemon(settings)
        daemon.start()
        http = httpx.Client(
            base_url=f"http://127.0.0.1:{settings.http_port}",
            timeout=30,
            headers={"Authorization": f"Bearer {token}"},
        )
        fleet = SlowFleet(daemon, Cluster(tmp / "unused"), tmp, http)
        fleet.lab, fleet.hosts = lab, hosts
        try:
            fleet.trainer(1, 0)
            fleet.generator(0, 1, 0)
            fleet.ready(180)
            yield fleet
        finally:
            lab.cluster.stop()
            http.close()
            daemon.stop()


def _url(fleet: SlowFleet) -> str:
    return f"http://127.0.0.1:{fleet.daemon.settings.http_port}"


def test_watch_json_follows_a_slow_refit_with_an_eta_that_holds(slow_fleet: SlowFleet) -> None:
    fleet = slow_fleet
    fleet.announce(1)
    refit_id = fleet.http.post("/v1/refits", json={"weight_version": 1}).json()["id"]
    watch = subprocess.run(
        [PYTHON, "-m", "syncd.cli", "--url", _url(fleet), "watch", refit_id, "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert watch.returncode == 0, watch.stderr
    updates = [json.loads(line) for line in watch.stdout.splitlines()]
    final = updates[-1]
    assert final["state"] == "COMMITTED", final["error"]
    assert final["phases"]["TRANSFERRING"] >= 10, "the link is too fast for this test"
    moving = [u for u in updates if u["state"] == "TRANSFERRING" and u["progress"]["bytes_total"]]
    assert len(moving) >= 5
    done = [u["progress"]["bytes_done"] for u in updates if u["progress"]]
    assert done == sorted(done) and len(set(done)) >= 5
    assert final["progress"]["fraction"] == 1.0
    assert final["progress"]["bytes_done"] == final["progress"]["bytes_total"] > 40 << 20

    half = next(u["progress"] for u in moving if u["progress"]["fraction"] >= 0.5)
    actually_left = final["finished_at"] - half["updated_at"]
    assert half["eta_source"] == "live" and half["slowest"]["dst"] == "generator-0-0"
    assert abs(half["eta_s"] - actually_left) <= 0.25 * actually_left, (half["eta_s"], actually_left)


def _require_tmux() -> None:
    if shutil.which("tmux") is None:
        reason = "`tmux` not found on PATH (Debian package tmux: `make tools` installs it as root)"
        if os.environ.get("WEIGHTSYNC_REQUIRE_TOOLS") == "1":
            pytest.fail(f"WEIGHTSYNC_REQUIRE_TOOLS=1 but {reason}")
        pytest.skip(reason)


def test_refit_wait_in_a_terminal_draws_moving_bars(slow_fleet: SlowFleet) -> None:
    _require_tmux()
    fleet = slow_fleet
    fleet.announce(2)
    socket = f"weightsync-{os.getpid()}"
    command = (
        f"env PYTHONPATH={REPO} {PYTHON} -m syncd.cli --url {_url(fleet)} "
        f"--token-file {fleet.lab.cluster.env[ENV_TOKEN_FILE]} refit --wait; sleep 600"
    )
    tmux = ["tmux", "-L", socket]
    subprocess.run([*tmux, "new-session", "-d", "-s", "refit", "-x", "160", "-y", "20", command], check=True)
    screens: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            screen = subprocess.run(
                [*tmux, "capture-pane", "-p", "-t", "refit"], capture_output=True, text=True, check=True
            ).stdout
            screens.append(screen)
            if "COMMITTED" in screen or "ABORTED" in screen:
                break
            time.sleep(0.5)
    finally:
        subprocess.run([*tmux, "kill-server"], check=False)
    assert "refit-2 COMMITTED" in screens[-1], screens[-1]
    # The refit's bar while it transfers: `refit-2 TRANSFERRING ━━━━╸━━━━  45.2%  18.6 MiB/41.3 MiB ...`
    bar = re.compile(r"refit-2 TRANSFERRING\s+([━╸╺ ]+)\s+(\d+\.\d)%\s+\S+ \S+/\S+ \S+")
    shown = [float(m.group(2)) for s in screens for m in [bar.search(s)] if m is not None]
    moving = sorted({p for p in shown if 0 < p < 100})
    assert len(moving) >= 3, screens
    assert shown == sorted(shown), "the bar went back"
    assert "generator-0-0" in next(s for s in screens if bar.search(s))  # its member's bar too
