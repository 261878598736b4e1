"""Waiting for a version over HTTP (`GET /v1/weight_version?at_least=` / `?exact=`): a trainer
several versions ahead of the rollouts never makes a wait for an older version time out.

The generator's real routes and `Refitter`, with the stand-in engine of test_commit_deadline.py
(every install completes at once here); the versions arrive through the real commit route, as
syncd's Commits do.
"""

from __future__ import annotations

from fastapi.testclient import TestClient

from tests.generator.test_commit_deadline import commit, generator

__all__ = ["generator"]


def _wait(http: TestClient, **query: object) -> tuple[int, dict]:
    r = http.get("/v1/weight_version", params={"timeout_s": 0, **query})
    return r.status_code, r.json()


def test_a_wait_returns_the_version_served_once_it_is_the_one_asked_for_or_newer(generator) -> None:
    http, engine, refitter = generator
    engine.release.set()
    status, body = _wait(http, at_least="2")
    assert status == 504, body
    assert "the engine serves version '1', not '2' or newer, after 0 s" in body["error"]["message"]
    for version in (2, 3, 4):  # the trainer ran three versions ahead of the rollout loop
        assert commit(http, version, 30, token=refitter.commit_token) == 200
    for step in (2, 3, 4):  # the loop's wait_version(step) for each step it skipped
        assert _wait(http, at_least=str(step)) == (
            200,
            {"version": "4", "step": 4, "serving": True, "updating": False},
        )
    status, body = _wait(http, exact="2")
    assert status == 504 and "serves version '4', not '2', after 0 s" in body["error"]["message"], body
    assert _wait(http, exact="4")[0] == 200
    assert _wait(http, at_least="base")[0] == 504  # a label that names no step is reached only by itself
    status, body = _wait(http, at_least="2", exact="2")
    assert status == 400 and "not both" in body["error"]["message"], body
