"""A refit's live progress through the real syncd: members' progress reports (the real client's
`report_progress` over gRPC) show in `GET /v1/refits/{id}` (bytes per member and link, the
slowest named) and in its server-sent events, which end at 100% with the refit; a second refit
gets an ETA from the first before any byte moved."""

from __future__ import annotations

import json
import threading
from collections import defaultdict

import httpx
from syncd_harness import Cluster, wait_until

from syncd.commands import ExecutePlan


def _incoming(cmd: ExecutePlan, member_id: str) -> dict[tuple[int, str], int]:
    links: dict[tuple[int, str], int] = defaultdict(int)
    for b in cmd.buckets:
        if b.dst == member_id:
            links[(b.stage, b.src)] += b.nbytes
    return dict(links)


def _events(url: str, refit_id: str, out: list[tuple[str, dict]]) -> None:
    with httpx.stream("GET", f"{url}/v1/refits/{refit_id}/events", timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = ""
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                out.append((name, json.loads(line[len("data: ") :])))


def test_progress_shows_in_the_refit_and_its_events_until_it_commits(cluster: Cluster) -> None:
    halfway, go_on = threading.Event(), threading.Event()

    def half_then_wait(cmd: ExecutePlan) -> None:
        gen = cluster.members["generator-0-0"].client
        gen.report_progress(cmd.refit_id, {k: n // 2 for k, n in _incoming(cmd, gen.member_id).items()})
        halfway.set()
        go_on.wait(30)

    cluster.start_all(**{"generator-0-0": {"on_execute": half_then_wait}})
    cluster.announce(1)
    refit_id = cluster.refit()["id"]
    events: list[tuple[str, dict]] = []
    reader = threading.Thread(target=_events, args=(cluster.url, refit_id, events), daemon=True)
    reader.start()
    assert halfway.wait(30)

    def progress() -> dict:
        return cluster.http.get(f"/v1/refits/{refit_id}").json()["progress"]

    wait_until(lambda: progress()["bytes_done"] > 0, what="the generator's progress to show")
    p = progress()
    assert p["state"] == "TRANSFERRING" and 0 < p["bytes_done"] < p["bytes_total"]
    members = {m["member_id"]: m for m in p["members"]}
    assert 0.4 < members["generator-0-0"]["fraction"] < 0.6
    assert {(k["src"], k["dst"]) for k in p["links"]} == {
        (t, g) for t in ("trainer-0", "trainer-1") for g in ("generator-0-0", "generator-0-1")
    }
    assert p["slowest"] is not None and p["slowest"]["dst"] == "generator-0-0"
    assert p["eta_source"] == "live" and p["eta_s"] is not None
    metrics = cluster.http.get("/metrics").text
    assert "weightsync_syncd_refit_in_flight 1.0" in metrics
    assert f"weightsync_syncd_refit_total_bytes {float(p['bytes_total'])}" in metrics
    assert 'weightsync_syncd_link_rate_bytes{dst="generator-0-0",src="trainer-0",stage="0"}' in metrics

    go_on.set()
    done = cluster.wait_refit(refit_id)
    assert done["state"] == "COMMITTED", done["error"]
    final = cluster.http.get(f"/v1/refits/{refit_id}").json()["progress"]
    assert final["state"] == "COMMITTED" and final["fraction"] == 1.0
    metrics = cluster.http.get("/metrics").text
    assert (
        "weightsync_syncd_refit_in_flight 0.0" in metrics
        and "weightsync_syncd_refit_eta_seconds NaN" in metrics
    )
    done_total = f"{float(final['bytes_total'])}"
    assert f"weightsync_syncd_refit_done_bytes {done_total}" in metrics  # the last refit, as it ended
    reader.join(30)
    progress_events = [body for name, body in events if name == "progress"]
    done_bytes = [e["progress"]["bytes_done"] for e in progress_events if e["progress"]]
    assert done_bytes == sorted(done_bytes) and done_bytes[-1] == final["bytes_total"]
    assert progress_events[-1]["state"] == "COMMITTED"
    assert events[-1] == ("end", {"id": refit_id, "state": "COMMITTED"})


def test_before_any_byte_moved_the_eta_comes_from_past_refits(cluster: Cluster) -> None:
    seen: list[dict] = []
    looked = threading.Event()

    def look(cmd: ExecutePlan) -> None:
        seen.append(cluster.http.get(f"/v1/refits/{cmd.refit_id}").json()["progress"])
        looked.set()

    def after_the_look(cmd: ExecutePlan) -> None:  # the generators move nothing before it
        looked.wait(30)

    waiting = {"on_execute": after_the_look}
    cluster.start_all(
        **{"trainer-0": {"on_execute": look}, "generator-0-0": waiting, "generator-0-1": waiting}
    )
    for version in (1, 2):
        looked.clear()
        cluster.announce(version)
        assert cluster.wait_refit(cluster.refit()["id"])["state"] == "COMMITTED"
    first, second = seen
    assert first["eta_source"] == "none" and first["eta_s"] is None  # nothing learnt yet
    assert second["eta_source"] == "model" and second["eta_s"] is not None and second["eta_s"] >= 0


def test_an_unknown_refit_has_no_event_stream(cluster: Cluster) -> None:
    r = cluster.http.get("/v1/refits/refit-404/events")
    assert r.status_code == 404 and "refit-404" in r.json()["error"]["message"]
