"""schemathesis, as users run it (`st run URL/openapi.json`), against a live service; returns
what it found as {(check code, title): [operations]} from its JSON report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from syncd import http_client

MAX_EXAMPLES = 10  # per operation and phase: keeps a run at seconds to a minute
SEED = 20  # reproducible runs: a failure names a case that `st replay` can repeat
# The stateful phase chains calls whose answers depend on timing (a refit still running or
# already finished), so its findings are not reproducible run to run; the other phases are.
PHASES = "examples,coverage,fuzzing"


def run_schemathesis(url: str, work: Path, config: str, *options: str) -> dict[tuple[str, str], list[str]]:
    """`config`: the text of a schemathesis.toml (auth, per-operation settings)."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "schemathesis.toml").write_text(config)
    report = work / "report.json"
    # Fetched here: vLLM builds its large document on the first request, slower than st's timeout.
    schema = work / "openapi.json"
    schema.write_bytes(http_client.get(f"{url}/openapi.json", timeout=120).raise_for_status().content)
    st = Path(sys.executable).parent / "st"
    result = subprocess.run(
        [
            str(st),
            "--config-file",
            str(work / "schemathesis.toml"),
            "run",
            str(schema),
            "--url",
            url,
            "--phases",
            PHASES,
            "--max-examples",
            str(MAX_EXAMPLES),
            "--seed",
            str(SEED),
            "--workers",
            "1",
            "--no-color",
            "--generation-database",
            "none",
            "--report",
            "json",
            "--report-json-path",
            str(report),
            *options,
        ],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=work,
    )
    (work / "schemathesis.log").write_text(result.stdout + result.stderr)  # the cases, to replay
    if not report.exists():
        raise AssertionError(
            f"schemathesis wrote no report (exit {result.returncode}):\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    body = json.loads(report.read_text())
    assert not body["errors"], f"schemathesis errors: {body['errors']}\n{result.stdout[-3000:]}"
    assert body["operations"]["tested"] > 0, body["operations"]
    return {(f["code"], f["title"]): sorted(f["operations"]) for f in body["failures"]}
