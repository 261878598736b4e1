"""End to end: trainer_svc (torchrun, gloo) -> syncd -> generator_svc (vLLM on CPU), real processes.

After a refit the generator must generate exactly as an engine holding the trainer's HF export of
the same step: here the generator itself after loading the export through vLLM's own loaders
(tests/generator shows that such a load generates exactly as a fresh engine), which keeps the
matrix affordable. The layouts (1,2,2) and (2,2,1), into a TP-1 and a TP-2 generator fed by one
refit and compared after every step, are in test_formats_e2e.py.
A real Prometheus scrapes one of these refits and runs the dashboard's and the alerts' queries.
"""

from __future__ import annotations

import pytest
from e2e_harness import wait_until
from openapi_fuzz import run_schemathesis
from prometheus_server import ALERTS, PrometheusServer, alert_rules, as_bool, dashboard_queries

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

LAYOUTS = [(1, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 1)]  # (pp, ep, tp); more in test_formats_e2e.py


@pytest.fixture(scope="module")
def generator(stack, model):
    stack.start_syncd(trainers=1)
    return stack.start_generator(model)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "pp{}-ep{}-tp{}".format(*l))
def test_refit_from_every_trainer_layout_equals_the_trainers_export(
    stack, generator, model, layout, tmp_path
):
    stack.start_syncd(trainers=layout[0] * layout[1] * layout[2], db=f"{tmp_path.name}.db")
    states = stack.train_and_refit(model, layout, tmp_path / "export")
    assert [s["state"] for s in states] == ["COMMITTED"], states
    after_refit = generator.greedy()
    generator.load(tmp_path / "export" / "step-1", version=1001)
    assert after_refit == generator.greedy()


# The trainer's second step races the restart: if it announces while syncd is down, the version
# reaches the restarted syncd when the rank re-registers, and the rank waits for that refit
# (trainer_svc.agent.RankAgent.on_step; before, it gave up and the job exited).
def test_refit_after_a_syncd_restart_keeps_history_and_commits(stack, generator, model, tmp_path):
    stack.start_syncd(trainers=1, db="restart.db")
    trainer = stack.train(model, pp=1, ep=1, tp=1, steps=2, export=tmp_path / "export")
    stack.wait_announced(1)
    first = stack.refit(1)
    assert first["state"] == "COMMITTED", first

    stack.start_syncd(trainers=1, db="restart.db")  # a restart on the same database
    history = stack.http.get("/v1/refits").json()
    assert first["id"] in str(history)
    assert stack.http.get("/v1/status").json()["committed_version"] == 1
    stack.wait_ready()  # both services re-registered by themselves
    stack.wait_announced(2)  # the rank re-registered with version 1 if its step 2 had not ended
    second = stack.refit(2)
    assert second["state"] == "COMMITTED", second
    assert trainer.popen.wait(180) == 0, trainer.tail()
    after_refit = generator.greedy()
    generator.load(tmp_path / "export" / "step-2", version=3000)
    assert after_refit == generator.greedy()


def test_sender_killed_mid_transfer_aborts_and_the_generator_keeps_serving(stack, generator, model, tmp_path):
    # Tiny buckets stretch the transfer over seconds, so the kill lands mid-transfer.
    stack.start_syncd(trainers=2, db="abort.db", bucket_bytes=512)
    committed = generator.greedy()
    state = stack.refit_with_a_rank_killed(model, tmp_path / "export")
    assert state["state"] == "ABORTED", state
    assert generator.greedy() == committed  # the committed version, untouched

    # A new trainer job; a fresh database, since the killed job's announced version would
    # otherwise trigger the refit before the new job has taken its step.
    stack.start_syncd(trainers=1, db="after-abort.db")
    states = stack.train_and_refit(model, (1, 1, 1), tmp_path / "export2")
    assert states[0]["state"] == "COMMITTED", states
    # Against the new job's export, not "different from before": the generator is shared by the
    # module's tests, and what an earlier test left it serving may equal this job's step.
    after_refit = generator.greedy()
    generator.load(tmp_path / "export2" / "step-1", version=4000)
    assert after_refit == generator.greedy()


# After a healthy refit every alert is quiet, except that the trainer job has finished (its
# process exits after its step), so a member did leave: WeightsyncMemberLost may hold.
MAY_HOLD_AFTER_THE_TRAINER_EXITS = {"WeightsyncMemberLost"}
# Series labelled by adapter exist once a named adapter was refitted (adapter slots): after a
# base refit their panels' queries run (Prometheus parses and evaluates them) and return nothing.
ONLY_AFTER_ADAPTER_REFITS = "weightsync_syncd_adapter_"


def test_prometheus_sees_the_refit_and_every_dashboard_and_alert_query_returns_samples(
    stack, generator, model, tmp_path
):
    """A real Prometheus scrapes syncd and the generator through a refit: the refit shows in
    weightsync_syncd_refits_total, every Grafana query and alert expression returns samples through
    Prometheus's HTTP API, and the alert rules evaluate without error."""
    syncd_target = f"127.0.0.1:{stack.http_port}"  # the same port across syncd restarts
    generator_target = str(generator.http.base_url).removeprefix("http://").rstrip("/")
    prometheus = PrometheusServer(
        stack.cluster,
        tmp_path / "prometheus",
        {"syncd": [syncd_target], "generator": [generator_target]},
        [ALERTS],
    )
    try:
        stack.start_syncd(trainers=1, db="prometheus.db")
        up = {
            (("instance", syncd_target), ("job", "syncd")): 1.0,
            (("instance", generator_target), ("job", "generator")): 1.0,
        }
        wait_until(
            lambda: prometheus.values("up") == up, 60, "Prometheus scraping syncd and the generator"
        )  # before the refit

        states = stack.train_and_refit(model, (1, 1, 1), tmp_path / "export")
        assert states[0]["state"] == "COMMITTED", states
        refits = 'sum by (outcome) (weightsync_syncd_refits_total{job="syncd"})'
        wait_until(
            lambda: (
                prometheus.values(refits)
                == {(("outcome", "committed"),): 1.0, (("outcome", "aborted"),): 0.0}
            ),
            30,
            f"the committed refit in Prometheus ({refits})",
        )
        served = 'weightsync_generator_weight_version{job="generator"}'
        wait_until(
            lambda: list(prometheus.values(served).values()) == [1.0],
            30,
            "the generator's version 1 in Prometheus",
        )

        # rate() over a series born in this refit (the phase histograms) needs two scrapes of it.
        def empty() -> list[str]:
            return [
                f"{title}: {expr}"
                for title, expr in dashboard_queries()
                if not prometheus.query(expr) and ONLY_AFTER_ADAPTER_REFITS not in expr
            ]

        try:
            wait_until(lambda: not empty(), 30, "every dashboard query to return samples")
        except AssertionError:
            raise AssertionError(
                "dashboard queries without samples after a refit:\n" + "\n".join(empty())
            ) from None
        for alert, expr in alert_rules().items():
            values = prometheus.values(as_bool(expr))
            assert values, f"{alert}: {expr} selects no series"
            if alert not in MAY_HOLD_AFTER_THE_TRAINER_EXITS:
                assert set(values.values()) == {0.0}, f"{alert} would fire after a healthy refit: {values}"
        rules = wait_until(
            lambda: (r := prometheus.rules()) and all(x["health"] != "unknown" for x in r) and r,
            30,
            "Prometheus to evaluate the alert rules",
        )
        assert sorted(r["name"] for r in rules) == sorted(alert_rules())
        assert [(r["name"], r["lastError"]) for r in rules if r["health"] != "ok"] == []
    finally:
        prometheus.close()


def test_as_bool_makes_only_the_top_level_comparison_bool():
    assert as_bool('up{job="syncd"} == 0') == 'up{job="syncd"} == bool 0'
    assert (
        as_bool('a{x="1"} < on() group_left() max(b{y=~"a|b"})')
        == 'a{x="1"} < bool on() group_left() max(b{y=~"a|b"})'
    )
    with pytest.raises(ValueError, match="found 0"):
        as_bool("rate(x[5m])")


# The workers' routes take int64 versions (`maximum: 2**63 - 1`). schemathesis derives boundary
# values in doubles, where 2**63 - 1 rounds up, so it sends 2**63 + 192 as "schema-valid"; the 400 is
# right (the exact bounds: tests/unit/test_weight_version.py), as for syncd's POST /v1/refits.
# A version waited for (`at_least`, `exact`) that never comes holds a request for `timeout_s`: the
# fuzzer asks without waiting, or its random versions would each hold one for up to a minute.
_GENERATOR_FUZZ_CONFIG = """
[[operations]]
include-path-regex = "^/internal/(commit|hold|adapters/commit)$"
checks.positive_data_acceptance.enabled = false

[[operations]]
include-path-regex = "^/v1/weight_version$"
parameters = { "query.timeout_s" = 0 }
"""


def test_schemathesis_finds_nothing_in_the_generators_own_routes(generator, tmp_path):
    """schemathesis against the generator's OpenAPI document, on generator_svc's routes (health,
    versions, workers, manual weight routes; vLLM's OpenAI routes are vLLM's contract). Last in
    this module: it sends the weight routes random input."""
    url = str(generator.http.base_url).rstrip("/")
    found = run_schemathesis(
        url,
        tmp_path,
        _GENERATOR_FUZZ_CONFIG,
        "--include-path-regex",
        r"^/(healthz|readyz|v1/weight_version|v1/workers.*|v1/weights/.*|internal/.*)$",
    )
    assert found == {}, f"schemathesis found: {found} (cases in {tmp_path / 'schemathesis.log'})"
    assert generator.greedy()  # and it still serves
