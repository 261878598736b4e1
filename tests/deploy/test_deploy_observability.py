"""deploy/observability: the dashboard and alert rules query only metrics the services export, with
labels those metrics have. Names come from the services' prometheus_client registries."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from deploy_tools import REPO

OBSERVABILITY = REPO / "deploy" / "observability"
# Series Prometheus itself makes for every target: not ours to export.
PROMETHEUS_SERIES = {"up": set()}
PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "le",
}


def _exported() -> dict[str, set[str]]:
    """Every sample name syncd and generator_svc expose on /metrics, with its label names."""
    import prometheus_client

    import generator_svc.server.metrics  # noqa: F401 - registers its metrics in the default registry
    from syncd.daemon.metrics import Metrics

    families = list(Metrics().registry.collect())
    families += [f for f in prometheus_client.REGISTRY.collect() if f.name.startswith("weightsync_")]
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    out: dict[str, set[str]] = {}
    for family in families:
        labels = _declared_labels(family.name)
        for suffix in suffixes[family.type]:
            extra = {"le"} if suffix == "_bucket" else set()
            out.setdefault(family.name + suffix, set()).update(labels | extra)
    return out


def _declared_labels(name: str) -> set[str]:
    """Label names of the metric `name`. A labelled metric with no children yet has no samples to
    read them from, and prometheus_client has no public accessor, hence `_labelnames`."""
    import prometheus_client

    import generator_svc.server.metrics as gen
    from syncd.daemon.metrics import Metrics

    metrics = Metrics()
    base = prometheus_client.metrics.MetricWrapperBase
    collectors = [v for v in [*vars(metrics).values(), *vars(gen).values()] if isinstance(v, base)]
    return {label for c in collectors if c._name == name for label in c._labelnames}


EXPORTED = _exported()
TARGET_LABELS = {"job", "instance"}  # added by Prometheus at scrape time


def _queries() -> list[tuple[str, str]]:
    dashboard = json.loads((OBSERVABILITY / "grafana-dashboard.json").read_text())
    out = [(f"panel {p['title']!r}", t["expr"]) for p in dashboard["panels"] for t in p["targets"]]
    rules = yaml.safe_load((OBSERVABILITY / "alerts.yaml").read_text())
    out += [(f"alert {r['alert']}", r["expr"]) for g in rules["groups"] for r in g["rules"]]
    return out


QUERIES = _queries()


def _selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric name, label names in its {...} matcher) for every series the expression selects."""
    found = []
    for m in re.finditer(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^}]*\})?", expr):
        name, matcher = m.group(1), m.group(2) or ""
        if name.startswith("weightsync_") or name in PROMETHEUS_SERIES:
            found.append((name, set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matcher))))
    return found


def test_there_is_something_to_check():
    assert len(QUERIES) >= 10 and all(_selectors(expr) for _, expr in QUERIES)


@pytest.mark.parametrize("where,expr", QUERIES, ids=[w for w, _ in QUERIES])
def test_every_queried_metric_is_exported_with_those_labels(where, expr):
    for name, labels in _selectors(expr):
        known = PROMETHEUS_SERIES.get(name, EXPORTED.get(name))
        assert known is not None, f"{where} queries {name}, which no service exports: {sorted(EXPORTED)}"
        unknown = labels - known - TARGET_LABELS
        assert not unknown, f"{where}: {name} has no label(s) {sorted(unknown)}; it has {sorted(known)}"
    grouped = set()
    for clause in re.findall(r"\bby\s*\(([^)]*)\)", expr):
        grouped |= {label.strip() for label in clause.split(",")}
    names = {n for n, _ in _selectors(expr)}
    available = set().union(*(EXPORTED.get(n, set()) for n in names)) | TARGET_LABELS
    assert grouped <= available, f"{where} groups by {sorted(grouped - available)}, a label its metrics lack"


def test_selector_parsing_sees_names_and_labels():
    assert _selectors('sum by (role) (rate(weightsync_syncd_members{job="syncd", role!="x"}[5m]))') == [
        ("weightsync_syncd_members", {"job", "role"})
    ]


def test_every_metric_each_service_exports_is_on_the_dashboard():
    dashboard = (OBSERVABILITY / "grafana-dashboard.json").read_text()
    families = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in EXPORTED}
    # The catalog size is static (it changes only with the model): not worth a panel.
    missing = {f for f in families if f not in dashboard} - {"weightsync_generator_catalog_bytes"}
    assert not missing, f"exported but not graphed: {sorted(missing)}"


def test_alert_rules_are_well_formed():
    rules = yaml.safe_load((OBSERVABILITY / "alerts.yaml").read_text())
    alerts = [r for g in rules["groups"] for r in g["rules"]]
    required = {"WeightsyncRefitFailed", "WeightsyncRefitSlow", "WeightsyncMemberLost"}
    assert required <= {r["alert"] for r in alerts}
    for r in alerts:
        assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}, r["alert"]
        assert r["labels"]["severity"] in ("warning", "critical")
        assert {"summary", "description"} <= set(r["annotations"])
        assert r["expr"].count("(") == r["expr"].count(")")
        if "for" in r:
            assert re.fullmatch(r"[0-9]+[smh]", r["for"])
    readme = (REPO / "deploy" / "README.md").read_text()
    for r in alerts:
        assert r["alert"] in readme, f"deploy/README.md does not explain {r['alert']}"


def test_dashboard_panels_have_unique_ids_and_fit_the_grid():
    dashboard = json.loads((OBSERVABILITY / "grafana-dashboard.json").read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert all(p["gridPos"]["x"] + p["gridPos"]["w"] <= 24 for p in dashboard["panels"])


def test_metric_names_say_which_service_and_follow_prometheus_units():
    """syncd's names start `weightsync_syncd_`, the generator's `weightsync_generator_`, so the two
    never share a name; counters end `_total` on the wire, and time and size carry `_seconds` and
    `_bytes`."""
    import prometheus_client

    import generator_svc.server.metrics  # noqa: F401 - registers its metrics in the default registry
    from syncd.daemon.metrics import Metrics

    syncd = {f.name: f.type for f in Metrics().registry.collect()}
    generator = {
        f.name: f.type for f in prometheus_client.REGISTRY.collect() if f.name.startswith("weightsync_")
    }
    assert syncd and all(n.startswith("weightsync_syncd_") for n in syncd), sorted(syncd)
    assert generator and all(n.startswith("weightsync_generator_") for n in generator), sorted(generator)
    for name, kind in {**syncd, **generator}.items():
        assert kind != "histogram" or name.endswith("_seconds"), name
        assert not re.search(r"_(bytes|seconds)_.", name), name  # the unit ends the name
