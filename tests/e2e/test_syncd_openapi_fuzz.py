"""schemathesis against a real `python -m syncd` (auth on, members registered so refits really
run) through its OpenAPI document: no server errors, responses as documented, invalid input
rejected, unsupported methods answered as HTTP requires. The explicit probes cover what a bounded
run does not reach (unannounced versions are refused with 409 before the number matters)."""

from __future__ import annotations

import pytest
from openapi_fuzz import run_schemathesis

from syncd import http_client
from syncd.net import free_port
from tests.control.syncd_harness import MEMBERS, TOKEN, SyncdProcess, make_member
from tests.polling import wait_until

CONFIG = f"""
# /readyz answers 503 by design while members are missing (documented in the schema).
[[operations]]
include-path = "/readyz"
checks.not_a_server_error.enabled = false

# Versions are int64 (`maximum: 2**63 - 1`). schemathesis derives boundary values in doubles, where
# 2**63 - 1 rounds up, so it sends 2**63 + 190 as "schema-valid"; syncd's 422 is right. The exact
# bounds are probed below (`test_a_weight_version_that_is_no_int64_is_a_422`).
[[operations]]
include-path = "/v1/refits"
include-method = "POST"
checks.positive_data_acceptance.enabled = false

# Requests carry the operator's token, so the fuzzing reaches the handlers behind the auth check.
[parameters]
"header.authorization" = "Bearer {TOKEN}"
"""


@pytest.fixture(scope="module")
def findings(tmp_path_factory):
    work = tmp_path_factory.mktemp("syncd-fuzz")
    syncd = SyncdProcess(
        work / "syncd.db",
        free_port(),
        free_port(),
        "--auth-token",
        TOKEN,
        "--expected-trainers",
        "2",
        "--expected-generators",
        "2",
        "--bucket-bytes",
        "256",
    ).start()
    members = [make_member(syncd.target, member_id, TOKEN) for member_id in MEMBERS]
    try:
        for m in members:
            m.client.start(m.handle)
        wait_until(lambda: http_client.get(f"{syncd.url}/readyz").status_code == 200, 30, "syncd ready")
        members[0].client.announce_version(1)
        yield syncd.url, run_schemathesis(syncd.url, work, CONFIG)
    finally:
        for m in members:
            m.client.close()
        syncd.stop()


def test_schemathesis_finds_nothing(findings):
    _, found = findings
    assert found == {}, f"schemathesis found: {found}"


@pytest.mark.parametrize("weight_version", [2**63, True, "7", 7.0], ids=["2**63", "true", "string", "float"])
def test_a_weight_version_that_is_no_int64_is_a_422(findings, weight_version):
    url, _ = findings
    r = http_client.post(
        f"{url}/v1/refits",
        json={"weight_version": weight_version},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert r.status_code == 422, (r.status_code, r.text)


def test_a_401_says_how_to_authenticate(findings):
    url, _ = findings
    r = http_client.post(f"{url}/v1/refits", json={})
    assert r.status_code == 401 and r.headers.get("www-authenticate", "").startswith("Bearer"), dict(
        r.headers
    )
