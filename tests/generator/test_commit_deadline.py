"""The commit route: authenticated, bounded by syncd's deadline, and a version whose install missed
the deadline never goes live.

The generator's real HTTP routes and `Refitter` run against a stand-in for vLLM's engine client
whose weight update blocks until the test releases it (an install slowed on purpose; a real engine
cannot be slowed from outside). Everything of generator_svc here is the real code.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from generator_svc.server import routes
from generator_svc.server.refit import Refitter
from generator_svc.settings import RefitMode, Settings
from generator_svc.worker_protocol import CommitOutcome, CommitReadiness
from tests.polling import wait_until


class SlowEngine:
    """vLLM's engine client as the Refitter uses it; `update_weights` waits for `release`."""

    errored = False

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.release = threading.Event()
        self.requests_done = threading.Event()  # running requests finished (pause may return)
        self.requests_done.set()

    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
        self.calls.append((method, *args))
        if method == "ws_status":
            return [CommitReadiness("generator-0-0", "r").to_wire()]
        return [None]

    @property
    def engine_core(self) -> SlowEngine:  # vLLM's core client, which takes the pause
        return self

    async def pause_scheduler_async(self, **_: object) -> None:
        self.calls.append(("pause",))
        while not self.requests_done.is_set():
            await asyncio.sleep(0.01)

    async def start_weight_update(self) -> None:
        self.calls.append(("start",))

    async def update_weights(self, request) -> None:
        self.calls.append(("update", request.update_info["version"]))
        while not self.release.is_set():
            await asyncio.sleep(0.01)

    async def finish_weight_update(self, weight_version: str) -> None:
        self.calls.append(("finish", weight_version))

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        self.calls.append(("reset_prefix_cache",))

    async def resume_generation(self) -> None:
        self.calls.append(("resume",))


@pytest.fixture
def generator():
    engine = SlowEngine()
    refitter = Refitter(
        engine,
        Settings(
            syncd="",
            replica=0,
            refit_mode=RefitMode.STAGED,
            initial_version="1",
            auth_token="",
            data_host="127.0.0.1",
        ),
    )
    app = FastAPI()
    routes.install(app, refitter)
    with TestClient(app) as http:
        yield http, engine, refitter


def commit(http: TestClient, version: int, timeout_s: float, token: str | None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return http.post(
        "/internal/commit",
        json={"refit_id": f"r{version}", "version": version, "timeout_s": timeout_s},
        headers=headers,
    ).status_code


def _served(http: TestClient) -> dict:
    return http.get("/v1/weight_version").json()


def test_commit_without_the_worker_token_is_refused_and_changes_nothing(generator) -> None:
    http, engine, refitter = generator
    engine.release.set()
    assert commit(http, 2, 30, token=None) == 401
    assert commit(http, 2, 30, token="guess") == 401
    assert engine.calls == []
    assert _served(http) == {"version": "1", "step": 1, "serving": True, "updating": False}
    assert commit(http, 2, 30, token=refitter.commit_token) == 200
    assert _served(http) == {"version": "2", "step": 2, "serving": True, "updating": False}


def test_an_install_past_the_deadline_gives_up_and_its_version_never_goes_live(generator) -> None:
    http, engine, refitter = generator
    # The install is blocked until released, so this answer can only come from the deadline.
    assert commit(http, 2, 0.5, token=refitter.commit_token) == 504
    assert ("update", "2") in engine.calls and ("finish", "2") not in engine.calls
    assert _served(http) == {"version": "1", "step": 1, "serving": False, "updating": True}
    assert http.post("/v1/completions", json={}).status_code == 503
    assert not any(c[0] == "ws_committed" for c in engine.calls), (
        "syncd hears of the failure from the workers"
    )

    engine.release.set()  # the slow install finishes after the failure was reported
    wait_until(
        lambda: not http.get("/v1/weight_version").json()["updating"], what="the late install to settle"
    )
    assert ("finish", "2") in engine.calls
    assert _served(http) == {"version": "1", "step": 1, "serving": False, "updating": False}
    assert ("resume",) not in engine.calls, "generation must not resume on a version reported failed"
    assert http.post("/v1/completions", json={}).status_code == 503

    install = http.get("/v1/install").json()
    assert (install["mode"], install["last"], install["history"]) == ("staged", None, [])

    assert commit(http, 3, 30, token=refitter.commit_token) == 200  # the next complete refit serves again
    assert _served(http) == {"version": "3", "step": 3, "serving": True, "updating": False}
    assert ("resume",) in engine.calls and engine.calls[-1] == (
        "ws_committed",
        CommitOutcome("r3", "3", ok=True).to_wire(),
    )
    assert http.get("/v1/install").json()["last"]["version"] == "3"


def test_a_deadline_that_passes_while_requests_finish_leaves_the_engine_untouched(generator) -> None:
    http, engine, refitter = generator
    engine.requests_done.clear()  # a long request is still running when the commit comes
    assert commit(http, 2, 0.5, token=refitter.commit_token) == 504
    engine.requests_done.set()
    wait_until(lambda: not http.get("/v1/weight_version").json()["updating"], what="the late pause to settle")
    assert ("start",) not in engine.calls, "the install must not begin after its deadline"
    assert _served(http) == {"version": "1", "step": 1, "serving": True, "updating": False}
    assert engine.calls[-1] == ("resume",)


def test_a_commit_without_a_positive_deadline_is_rejected(generator) -> None:
    http, _, refitter = generator
    assert commit(http, 2, 0, token=refitter.commit_token) == 422
