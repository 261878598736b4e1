"""The refit modes behind the generator's HTTP routes: the inplace hold (made by `/internal/hold`,
ended by exactly one of commit, release or the hold limit), what each mode refuses, and which
errors are the caller's (409) and which are failures (500).

The generator's real routes and `Refitter` run against a stand-in for vLLM's engine client that
records the calls and answers the workers' RPCs as the test sets them (an engine cannot be made
to fail at a chosen step from outside). Real engines drive these paths in tests/e2e.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from generator_svc.server import routes
from generator_svc.server.refit import Refitter
from generator_svc.settings import RefitMode, Settings
from generator_svc.worker.staging import Staging, StagingInputError
from generator_svc.worker.syncd_member import InplaceEndpoint, StagedEndpoint
from generator_svc.worker_protocol import CommitOutcome, CommitReadiness, StagedFile
from syncd.layout import Catalog
from tests.polling import wait_until


class RecordingEngine:
    """vLLM's engine client as the Refitter uses it. `answers[method]` computes a worker RPC's
    per-worker results (one worker); `failing` names the lifecycle steps that raise."""

    errored = False

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.answers: dict[str, Callable[..., list[Any]]] = {
            "ws_status": lambda: [CommitReadiness("generator-0-0", "r").to_wire()],
            "ws_release": lambda: [0],
            "ws_stage_file": lambda path, refit_id: [StagedFile("generator-0-0", tensors=3).to_wire()],
        }
        self.failing: set[str] = set()

    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
        self.calls.append((method, *args))
        if method in self.failing:
            raise RuntimeError(f"{method} broke")
        return self.answers[method](*args) if method in self.answers else [None]

    async def _step(self, name: str, *args: Any) -> None:
        self.calls.append((name, *args))
        if name in self.failing:
            raise RuntimeError(f"{name} broke")

    @property
    def engine_core(self) -> RecordingEngine:  # vLLM's core client, which takes the pause
        return self

    async def pause_scheduler_async(self, **_: object) -> None:
        await self._step("pause")

    async def start_weight_update(self) -> None:
        await self._step("start")

    async def update_weights(self, request: Any) -> None:
        await self._step("update", request.update_info["version"])

    async def finish_weight_update(self, weight_version: str) -> None:
        await self._step("finish", weight_version)

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        await self._step("reset_prefix_cache")

    async def resume_generation(self) -> None:
        await self._step("resume")

    def count(self, name: str) -> int:
        return sum(c[0] == name for c in self.calls)


Generator = tuple[TestClient, RecordingEngine, Refitter]


@contextlib.contextmanager
def _generator(mode: RefitMode, hold_limit_s: float = 300.0) -> Iterator[Generator]:
    engine = RecordingEngine()
    settings = Settings(
        syncd="",
        replica=0,
        refit_mode=mode,
        initial_version="1",
        auth_token="",
        data_host="127.0.0.1",
        hold_limit_s=hold_limit_s,
    )
    refitter = Refitter(engine, settings)
    app = FastAPI()
    routes.install(app, refitter)
    with TestClient(app) as http:
        yield http, engine, refitter


@pytest.fixture
def inplace() -> Iterator[Generator]:
    with _generator(RefitMode.INPLACE) as generator:
        yield generator


@pytest.fixture
def staged() -> Iterator[Generator]:
    with _generator(RefitMode.STAGED) as generator:
        yield generator


def _post(http: TestClient, refitter: Refitter, route: str, **body: object) -> Any:
    return http.post(route, json=body, headers={"Authorization": f"Bearer {refitter.commit_token}"})


def _served(http: TestClient) -> dict:
    return http.get("/v1/weight_version").json()


def test_a_hold_lasts_across_requests_until_its_commit(inplace) -> None:
    http, engine, refitter = inplace
    assert _post(http, refitter, "/internal/hold", refit_id="r2", version=2).status_code == 200
    assert _served(http) == {"version": "1", "step": 1, "serving": True, "updating": True}
    assert _post(http, refitter, "/internal/hold", refit_id="r2", version=2).status_code == 200
    assert engine.count("pause") == 1, "a retried hold for the held refit opens nothing again"

    r = _post(http, refitter, "/internal/commit", refit_id="r2", version=2, timeout_s=30)
    assert r.status_code == 200, r.text
    assert _served(http) == {"version": "2", "step": 2, "serving": True, "updating": False}
    assert engine.calls[-1] == ("ws_committed", CommitOutcome("r2", "2", ok=True).to_wire())
    # The hold ended with its commit: a second commit of it holds nothing.
    r = _post(http, refitter, "/internal/commit", refit_id="r2", version=2, timeout_s=30)
    assert r.status_code == 409 and "holds no in-place install" in r.json()["error"]["message"]
    assert http.get("/v1/install").json()["mode"] == "inplace"


def test_a_released_hold_before_any_layer_serves_on_and_ends_once(inplace) -> None:
    http, engine, refitter = inplace
    assert _post(http, refitter, "/internal/hold", refit_id="r2", version=2).status_code == 200
    assert _post(http, refitter, "/internal/release", refit_id="r2").json() == {
        "released": True,
        "serving": True,
    }
    assert engine.calls[-1] == ("resume",) and _served(http)["updating"] is False
    assert _post(http, refitter, "/internal/release", refit_id="r2").json()["released"] is False
    r = _post(http, refitter, "/internal/commit", refit_id="r2", version=2, timeout_s=30)
    assert r.status_code == 409 and _served(http)["version"] == "1"


def test_a_hold_released_after_layers_were_installed_refuses_generation(inplace) -> None:
    http, engine, refitter = inplace
    engine.answers["ws_release"] = lambda: [3]
    assert _post(http, refitter, "/internal/hold", refit_id="r2", version=2).status_code == 200
    assert _post(http, refitter, "/internal/release", refit_id="r2").json() == {
        "released": True,
        "serving": False,
    }
    assert ("resume",) not in engine.calls
    assert http.post("/v1/completions", json={}).status_code == 503


def test_a_hold_past_its_limit_is_released_by_its_watchdog() -> None:
    with _generator(RefitMode.INPLACE, hold_limit_s=0.2) as (http, engine, refitter):
        assert _post(http, refitter, "/internal/hold", refit_id="r2", version=2).status_code == 200
        wait_until(lambda: not _served(http)["updating"], what="the hold limit to release the hold")
        assert engine.count("ws_release") == 1 and engine.calls[-1] == ("resume",)
        r = _post(http, refitter, "/internal/commit", refit_id="r2", version=2, timeout_s=30)
        assert r.status_code == 409


def test_a_hold_for_a_newer_refit_releases_the_old_one_first(inplace) -> None:
    http, engine, refitter = inplace
    assert _post(http, refitter, "/internal/hold", refit_id="r2", version=2).status_code == 200
    assert _post(http, refitter, "/internal/hold", refit_id="r3", version=3).status_code == 200
    assert engine.count("ws_release") == 1 and engine.count("ws_hold") == 2
    assert engine.calls[-1] == ("ws_hold", "r3")
    assert _post(http, refitter, "/internal/release", refit_id="r2").json()["released"] is False
    r = _post(http, refitter, "/internal/commit", refit_id="r3", version=3, timeout_s=30)
    assert r.status_code == 200 and _served(http)["version"] == "3"


def test_a_hold_that_fails_to_open_is_a_500_and_serving_goes_on(inplace) -> None:
    http, engine, refitter = inplace
    engine.failing.add("ws_hold")
    r = _post(http, refitter, "/internal/hold", refit_id="r2", version=2)
    assert r.status_code == 500 and "ws_hold broke" in r.json()["error"]["message"]
    assert engine.calls[-2:] == [("ws_recover",), ("resume",)]
    assert _served(http) == {"version": "1", "step": 1, "serving": True, "updating": False}
    engine.failing.clear()
    assert _post(http, refitter, "/internal/hold", refit_id="r2", version=2).status_code == 200


def test_each_mode_refuses_what_only_the_other_does(inplace, staged) -> None:
    http, engine, refitter = inplace
    r = http.post("/v1/weights/stage", json={"path": "/any", "refit_id": "m"})
    assert r.status_code == 409 and "no staging" in r.json()["error"]["message"]
    assert not any(c[0] == "ws_stage_file" for c in engine.calls)
    http, engine, refitter = staged
    r = _post(http, refitter, "/internal/hold", refit_id="r2", version=2)
    assert r.status_code == 409 and "needs --refit-mode inplace" in r.json()["error"]["message"]
    assert engine.calls == []
    assert _post(http, refitter, "/internal/release", refit_id="r2").json()["released"] is False


def test_staging_input_a_worker_rejects_is_409_and_a_failure_is_500(staged) -> None:
    http, engine, _ = staged
    engine.answers["ws_stage_file"] = lambda path, refit_id: [
        StagedFile("generator-0-0", rejected=f"generator-0-0: no {path}").to_wire()
    ]
    r = http.post("/v1/weights/stage", json={"path": "/nowhere", "refit_id": "m"})
    assert r.status_code == 409 and r.json()["error"]["message"] == "generator-0-0: no /nowhere"
    assert engine.calls[-1] == ("ws_abort", "m"), "rejected staging is dropped"

    engine.failing.add("ws_stage_file")  # not the input: something broke
    r = http.post("/v1/weights/load", json={"path": "/ckpt", "version": "2"})
    assert r.status_code == 500 and "ws_stage_file broke" in r.json()["error"]["message"]
    assert engine.calls[-1] == ("ws_abort", "load-2") and _served(http)["version"] == "1"

    engine.failing = {"update"}  # inside the lifecycle: a 500, and generation refused
    r = http.post("/v1/weights/apply", json={"version": "2"})
    assert r.status_code == 500 and "update broke" in r.json()["error"]["message"]
    assert engine.calls[-1] == ("ws_recover",) and _served(http)["serving"] is False


def test_a_bug_in_a_route_is_a_500_not_a_409(staged) -> None:
    http, engine, _ = staged
    engine.answers["ws_status"] = lambda: [{"member_id": "generator-0-0"}]  # a malformed answer
    r = http.post("/v1/weights/apply", json={"version": "2"})
    assert r.status_code == 500 and r.json()["error"]["message"].startswith(
        "TypeError: expected a CommitReadiness"
    )
    assert ("pause",) not in engine.calls and _served(http)["serving"] is True


def test_the_refit_mode_is_one_of_the_enum_and_named_when_not() -> None:
    # Plain strings, as callers pass them, on purpose: hence the ignores.
    assert Settings("", 0, "inplace", "0", "", "h").refit_mode is RefitMode.INPLACE  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"refit_mode must be one of \['staged', 'inplace'\], got 'swap'"):
        Settings("", 0, "swap", "0", "", "h")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="inplace_delta_base is for --refit-mode inplace, not staged"):
        Settings("", 0, RefitMode.STAGED, "0", "", "h", inplace_delta_base=True)


def test_no_lock_is_held_between_requests(inplace) -> None:
    """The hold is an object, not a lock taken by one request and released by another: while a
    refit holds generation, requests that do not end the hold answer at once."""
    http, engine, refitter = inplace
    assert _post(http, refitter, "/internal/hold", refit_id="r2", version=2).status_code == 200
    assert http.post("/v1/weights/abort", json={}).status_code == 200
    assert _post(http, refitter, "/internal/release", refit_id="other").json()["released"] is False
    assert _served(http)["updating"] is True and engine.count("ws_release") == 0


@pytest.mark.parametrize(
    "path,message",
    [
        ("/", "no safetensors files at /"),
        ("/no/such/file.safetensors", "'/no/such/file.safetensors' is not a readable safetensors file"),
        ("\ud800", r"'\ud800' is not a readable safetensors file: UnicodeEncodeError"),
    ],
)
def test_staging_rejects_what_is_no_checkpoint_as_the_callers_input(
    path: str, message: str, tmp_path
) -> None:
    """What a worker returns as `{"rejected": ...}` (409), naming the path, never a 500."""
    with pytest.raises(StagingInputError) as raised:
        Staging(Catalog((), ())).fill_from_safetensors(path)
    assert str(raised.value).startswith(message)
    not_safetensors = tmp_path / "x.safetensors"
    not_safetensors.write_text("not a checkpoint")
    with pytest.raises(StagingInputError, match="SafetensorError"):
        Staging(Catalog((), ())).fill_from_safetensors(tmp_path)


def test_only_the_inplace_member_asks_for_buckets_cut_at_whole_layers() -> None:
    """An in-place install post-processes whole layers (registered as `receive_by_layer`)."""
    assert InplaceEndpoint.receive_by_layer is True
    assert StagedEndpoint.receive_by_layer is False
