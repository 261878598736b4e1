"""Waiting for a version over HTTP (`GET /v1/weight_version?at_least=V[&exact=true]`): a trainer
several versions ahead of the rollouts never makes a wait for an older version time out.

The generator's real routes and `Refitter`, with the stand-in engine of test_commit_deadline.py
(every install completes at once here); the versions arrive through the real commit route, as
syncd's Commits do.
"""

from __future__ import annotations

from fastapi.testclient import TestClient

from tests.generator.test_commit_deadline import commit, generator

__all__ = ["generator"]


def _served_after_wait(http: TestClient, **query: object) -> str:
    """The label a wait answers with (a long poll answers what is served when its time is up)."""
    r = http.get("/v1/weight_version", params={"timeout_s": 0, **query})
    assert r.status_code == 200, r.text
    return r.json()["version"]


def test_a_wait_returns_the_version_served_once_it_is_the_one_asked_for_or_newer(generator) -> None:
    http, engine, refitter = generator
    engine.release.set()
    assert _served_after_wait(http, at_least="2") == "1"  # not there yet: what is served
    for version in (2, 3, 4):  # the trainer ran three versions ahead of the rollout loop
        assert commit(http, version, 30, token=refitter.commit_token) == 200
    for step in (2, 3, 4):  # the loop's wait_version(step) for each step it skipped
        r = http.get("/v1/weight_version", params={"at_least": str(step), "timeout_s": 30})
        assert r.json() == {"version": "4", "step": 4, "serving": True, "updating": False}
    assert _served_after_wait(http, at_least="4", exact=True) == "4"
    assert _served_after_wait(http, at_least="2", exact=True) == "4"  # not 2: the wait ran out
