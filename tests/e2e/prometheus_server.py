"""A real Prometheus server for the tests (loopback only, a config and a data directory of the
test's own, scraping the given jobs every second and evaluating the given rule files), and the
queries users run against it: the Grafana dashboard's and the alert rules'."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import yaml

from deploy.local.processes import Cluster, Proc
from syncd.net import free_port
from tests.deploy.deploy_tools import require_tool

SCRAPE_INTERVAL = "1s"
OBSERVABILITY = Path(__file__).resolve().parents[2] / "deploy" / "observability"
ALERTS = OBSERVABILITY / "alerts.yaml"
# Grafana's rate window; a minute of 1 s scrapes covers a refit.
RATE_INTERVAL = "1m"


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of the Grafana dashboard, its rate window filled in."""
    dashboard = json.loads((OBSERVABILITY / "grafana-dashboard.json").read_text())
    return [
        (p["title"], t["expr"].replace("$__rate_interval", RATE_INTERVAL))
        for p in dashboard["panels"]
        for t in p["targets"]
    ]


def alert_rules() -> dict[str, str]:
    """Alert name -> expression, from alerts.yaml."""
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return {r["alert"]: r["expr"] for g in groups for r in g["rules"]}


def as_bool(expr: str) -> str:
    """The alert expression with its top-level comparison made a `bool` one, so it returns 0 or 1
    for every series it compares instead of only the series that fire."""
    depth, found = 0, []
    for m in re.finditer(r"[({\[]|[)}\]]|==|!=|>=|<=|>|<", expr):
        token = m.group()
        if token in "({[":
            depth += 1
        elif token in ")}]":
            depth -= 1
        elif depth == 0:
            found.append(m.end())
    if len(found) != 1:
        raise ValueError(f"expected one top-level comparison in {expr!r}, found {len(found)}")
    return expr[: found[0]] + " bool" + expr[found[0] :]


class PrometheusServer:
    def __init__(
        self, cluster: Cluster, work: Path, jobs: dict[str, list[str]], rule_files: list[Path]
    ) -> None:
        """`jobs`: job name -> host:port targets whose /metrics it scrapes."""
        binary = require_tool("prometheus")
        work.mkdir(parents=True, exist_ok=True)
        config = work / "prometheus.yml"
        config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
                    "rule_files": [str(p) for p in rule_files],
                    "scrape_configs": [
                        {"job_name": job, "static_configs": [{"targets": targets}]}
                        for job, targets in jobs.items()
                    ],
                }
            )
        )
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.proc: Proc = cluster.start(
            "prometheus",
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={work / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
        )
        cluster.wait_http(self.proc, f"{self.url}/-/ready", 60)
        self.http = httpx.Client(base_url=self.url, timeout=30)

    def _get(self, path: str, **params) -> dict:
        body = self.http.get(path, params=params).json()
        if body.get("status") != "success":
            raise AssertionError(f"Prometheus {path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query's samples: [{"metric": {labels}, "value": [time, "text"]}, ...]."""
        data = self._get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", f"{expr} gave a {data['resultType']}, not a vector"
        return data["result"]

    def values(self, expr: str) -> dict[tuple, float]:
        """An instant query's values by their sorted label pairs (the metric name left out)."""
        return {
            tuple(sorted((k, v) for k, v in s["metric"].items() if k != "__name__")): float(s["value"][1])
            for s in self.query(expr)
        }

    def rules(self) -> list[dict]:
        """Every loaded alerting rule with its health, last error and state."""
        return [
            r for g in self._get("/api/v1/rules")["groups"] for r in g["rules"] if r["type"] == "alerting"
        ]

    def close(self) -> None:
        self.http.close()
        self.proc.stop()
