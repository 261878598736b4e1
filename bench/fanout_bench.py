"""Fan-out benchmark in the lab (`deploy/lab`): refit time and the bytes that leave the trainer's
host for R = 1, 2, 4, 8 generator replicas, every host on its own shaped link.

    sudo python -m bench.fanout_bench --json bench/results/fanout-lab-DATE.json
    sudo python -m bench.fanout_bench --replicas 2 --reps 8 --progress-interval 0.25,0,0.25,0

The second compares refits with the members' progress reports on (every 0.25 s) and off (0),
sessions interleaved: `progress_cost` is the median refit time with them over without.

Hosts: `syncd`, `trainer` (every trainer rank: ep x tp plain-tensor ranks of the synthetic MoE,
`testkit/plain_member.py`) and `gen0` ... `gen7` (one TP-1 generator replica each, a plain member
standing in for vLLM). For each R, fresh processes: syncd, the trainer ranks and R replicas; one
warm-up refit (groups negotiated, buffers allocated), then `--reps` measured refits. A row holds the
median refit time (syncd's record: trigger to commit) and the median bytes the trainer host's
interface sent during a refit (its tx counter, `Lab.tx_bytes`), beside what the plan says.
Needs root (network namespaces, tc); refuses otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from deploy.lab import Lab
from deploy.local.processes import PYTHON, Proc
from syncd.member.agent.progress import PROGRESS_INTERVAL_ENV
from syncd.refit_wait import wait_final
from testkit.plain_member import RlSteps, loaded_marker, model_shape

HTTP_PORT, GRPC_PORT = 8470, 8471


def _members(lab: Lab, args, replicas: int, workdir: Path, steps: Steps, progress_s: float) -> list[Proc]:
    """syncd, the trainer ranks and `replicas` generators, each started on its lab host; `steps`:
    whether syncd runs delta refits, and which versions the trainers make RL-like steps;
    `progress_s`: seconds between the members' progress reports (0: none)."""
    progress = {PROGRESS_INTERVAL_ENV: str(progress_s)}
    syncd_at = f"{lab.address('syncd')}:{GRPC_PORT}"
    procs = [
        lab.spawn(
            "syncd",
            [PYTHON, "-m", "syncd", "--host", "0.0.0.0", "--http-port", str(HTTP_PORT), "--grpc-port",
             str(GRPC_PORT), "--db", str(workdir / f"syncd-{replicas}.db"), "--bucket-bytes",
             str(args.bucket_mib << 20), "--expected-trainers", str(args.ep * args.tp),
             "--expected-generators", str(replicas), "--backend", "gloo", "--fanout", str(args.fanout),
             "--transfer-timeout", "300", "--lease-seconds", "10",
             *(["--delta-refits"] if steps.delta else [])],
            name=f"syncd-r{replicas}",
        )
    ]  # fmt: skip
    model = ["--model", "moe", "--mib", str(args.mib), "--syncd", syncd_at]
    ranks = [(e, t) for e in range(args.ep) for t in range(args.tp)]
    procs += [
        lab.spawn(
            "trainer",
            [PYTHON, "-m", "testkit.plain_member", "--role", "trainer", *model, "--ep", str(args.ep),
             "--ep-rank", str(e), "--tp", str(args.tp), "--tp-rank", str(t),
             "--host", lab.address("trainer"), "--announce-file", str(workdir / "version"),
             "--rl-changed", str(steps.rl.fraction), "--rl-versions", f"{steps.rl.first},{steps.rl.last}"],
            name=f"trainer-{e}-{t}-r{replicas}",
            env=progress,
        )
        for e, t in ranks
    ]  # fmt: skip
    for r in range(replicas):
        host = f"gen{r}"
        procs.append(
            lab.spawn(
                host,
                [PYTHON, "-m", "testkit.plain_member", "--role", "generator", *model, "--replica", str(r),
                 "--host", lab.address(host), "--lean"],
                name=f"{host}-r{replicas}",
                env=progress,
            )
        )  # fmt: skip
    return procs


def _wait(http: httpx.Client, procs: list[Proc], predicate, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dead = [p for p in procs if not p.alive()]
        if dead:
            raise RuntimeError(f"{dead[0].name} exited:\n{dead[0].tail()}")
        try:
            if predicate():
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{what} after {timeout_s:.0f} s")


@dataclass(frozen=True)
class Steps:
    """One session's refits: `delta`, syncd's delta refits on; `rl`, the versions that are RL-like
    steps (the others change every element); `kinds`, per measured version (2, 3, ...), the
    row it counts in."""

    delta: bool
    rl: RlSteps
    kinds: tuple[str, ...]


def sessions(args) -> list[Steps]:
    """Without `--delta`, `--reps` full refits. With it, three kinds of rows from two sessions per
    replica count: full refits with delta refits off; then, with them on, `--reps` RL-like steps
    (versions 2 .. reps + 1, each a delta of the one before) and `--reps` steps that change every
    element (each its own random values)."""
    full = Steps(False, RlSteps(), ("full",) * args.reps)
    if not args.delta:
        return [full]
    rl = RlSteps(args.changed, 2, args.reps + 1)
    return [full, Steps(True, rl, ("rl-like",) * args.reps + ("everything",) * args.reps)]


def measure(lab: Lab, args, replicas: int, workdir: Path, steps: Steps, progress_s: float) -> list[dict]:
    """One session: fresh processes, a warm-up refit (version 1), then a refit per `steps.kinds`;
    a row per kind."""
    (workdir / "version").write_text("0")
    for old in workdir.glob("version.trainer-*"):
        old.unlink()
    for old in workdir.glob(f"syncd-{replicas}.db*"):  # a fresh syncd: no history, no versions
        old.unlink()
    token = lab.cluster.make_token(workdir)  # syncd serves the lab's network: every process gets it
    procs = _members(lab, args, replicas, workdir, steps, progress_s)
    headers = {"Authorization": f"Bearer {token}"}
    http = httpx.Client(base_url=f"http://{lab.address('syncd')}:{HTTP_PORT}", timeout=30, headers=headers)
    try:
        _wait(http, procs, lambda: http.get("/readyz").status_code == 200, "syncd not ready", 300)
        plan = http.get("/v1/plan").json()
        measured: dict[str, list[tuple[float, int, dict]]] = {}
        for version in range(1, len(steps.kinds) + 2):
            seconds, egress_bytes, record = _refit(lab, http, procs, args, workdir, replicas, version)
            if version > 1:  # the first refit negotiates the groups and allocates: a warm-up
                measured.setdefault(steps.kinds[version - 2], []).append((seconds, egress_bytes, record))
        rows = [_row(replicas, kind, steps.delta, runs, plan) for kind, runs in measured.items()]
        return [{**row, "progress_interval_s": progress_s} for row in rows]
    finally:
        http.close()
        for p in reversed(procs):
            p.stop(grace_s=10)


def _refit(lab: Lab, http: httpx.Client, procs, args, workdir: Path, replicas: int, version: int):
    """Announce `version` on every trainer rank, refit it; (seconds, trainer egress, record)."""
    (workdir / "version").write_text(str(version))
    markers = [loaded_marker(workdir / "version", f"trainer-{r}") for r in range(args.ep * args.tp)]
    _wait(
        http,
        procs,
        lambda: all(m.exists() and m.read_text() == str(version) for m in markers),
        f"version {version} not loaded by every trainer rank",
        120,
    )
    sent = lab.tx_bytes("trainer")
    r = http.post("/v1/refits", json={"weight_version": version})
    r.raise_for_status()
    record = wait_final(lambda path: http.get(path).json(), r.json()["id"], 600, poll_s=0.05)
    if record["state"] != "COMMITTED":
        raise RuntimeError(f"R={replicas}: refit of version {version} {record['state']}: {record['error']}")
    seconds = record["finished_at"] - record["created_at"]
    egress_bytes = lab.tx_bytes("trainer") - sent
    print(
        f"R={replicas} v{version} ({record['mode']}): {seconds:.2f} s, trainer sent "
        f"{egress_bytes / 1e6:.1f} MB, generators received {record['bytes'] / 1e6:.1f} MB",
        flush=True,
    )
    return seconds, egress_bytes, record


def _row(replicas: int, kind: str, delta: bool, runs: list[tuple[float, int, dict]], plan: dict) -> dict:
    """Medians of one kind of refit; `mode` is syncd's (delta: some generator received a delta)."""
    times = [t for t, _, _ in runs]
    egress = [e for _, e, _ in runs]
    records = [r for _, _, r in runs]
    modes = sorted({r["mode"] for r in records})
    fractions = [r["changed_fraction"] for r in records if r["changed_fraction"] is not None]
    return {
        "replicas": replicas,
        "step": kind,
        "mode": modes[0] if len(modes) == 1 else "/".join(modes),
        "delta_enabled": delta,
        "changed_fraction": round(statistics.median(fractions), 5) if fractions else None,
        "refit_s": round(statistics.median(times), 3),
        "trainer_egress_bytes": int(statistics.median(egress)),
        "received_bytes": int(statistics.median(r["bytes"] for r in records)),
        "refit_s_each": [round(t, 3) for t in times],
        "trainer_egress_bytes_each": egress,
        "plan_source_bytes": plan["source_bytes"],
        "plan_relay_bytes": plan["relay_bytes"],
    }


def delta_targets(rows: list[dict]) -> list[dict]:
    """Per replica count, the issue's bounds: an RL-like delta at most 1/3 of a full refit with
    delta refits off, and a step that changes everything, with them on, at most 1.10 x."""
    out = []
    for replicas in sorted({r["replicas"] for r in rows}):
        by_step = {r["step"]: r for r in rows if r["replicas"] == replicas}
        full = by_step["full"]["refit_s"]
        rl, dense = by_step["rl-like"]["refit_s"] / full, by_step["everything"]["refit_s"] / full
        out.append(
            {
                "replicas": replicas,
                "rl_like_vs_full": round(rl, 3),
                "rl_like_within_a_third": rl <= 1 / 3,
                "everything_vs_full": round(dense, 3),
                "everything_within_1_10": dense <= 1.10,
            }
        )
    return out


def progress_cost(rows: list[dict]) -> list[dict]:
    """Per replica count and step, the median refit time with progress reports over without,
    over every refit of the sessions of each (when both ran)."""
    out = []
    for replicas, step in sorted({(r["replicas"], r["step"]) for r in rows}):
        mine = [r for r in rows if r["replicas"] == replicas and r["step"] == step]
        on = [t for r in mine if r["progress_interval_s"] > 0 for t in r["refit_s_each"]]
        off = [t for r in mine if r["progress_interval_s"] == 0 for t in r["refit_s_each"]]
        if on and off:
            ratio = statistics.median(on) / statistics.median(off)
            out.append(
                {
                    "replicas": replicas,
                    "step": step,
                    "on_vs_off": round(ratio, 4),
                    "refits": len(on) + len(off),
                }
            )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", default="1,2,4,8")
    p.add_argument("--rate-gbit", type=float, default=1.0)
    p.add_argument("--mib", type=int, default=160, help="model size (bfloat16 synthetic MoE)")
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--bucket-mib", type=int, default=4)
    p.add_argument("--fanout", type=int, default=1, help="syncd --fanout (0: every replica from the trainer)")
    p.add_argument("--reps", type=int, default=3, help="measured refits per R (after one warm-up)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument(
        "--delta",
        action="store_true",
        help="also delta refits: RL-like steps and steps that change everything",
    )
    p.add_argument("--changed", type=float, default=0.025, help="--delta: elements an RL-like step moves")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/fanout-bench"))
    p.add_argument(
        "--progress-interval",
        default="0.25",
        help="seconds between members' progress reports (0: none); a comma list runs one session per "
        "value per replica count, in that order (0.25,0,0.25,0 interleaves on and off)",
    )
    args = p.parse_args()
    intervals = [float(s) for s in args.progress_interval.split(",")]
    counts = [int(r) for r in args.replicas.split(",")]
    args.workdir.mkdir(parents=True, exist_ok=True)
    shape = model_shape("moe", args.mib)
    model_bytes = sum(c.nbytes for c in shape.canonical())
    hosts = ["syncd", "trainer", *(f"gen{r}" for r in range(max(counts)))]
    with Lab(hosts, rate_gbit=args.rate_gbit, name="fanout", logs=args.workdir / "logs") as lab:
        rows = [
            row
            for replicas in counts
            for progress_s in intervals
            for steps in sessions(args)
            for row in measure(lab, args, replicas, args.workdir, steps, progress_s)
        ]
    for row in rows:  # against the first replica count's refit of the same kind
        base = next(r for r in rows if r["step"] == row["step"])
        row["egress_vs_first"] = round(row["trainer_egress_bytes"] / base["trainer_egress_bytes"], 3)
        row["time_vs_first"] = round(row["refit_s"] / base["refit_s"], 3)
    result = {
        "link_gbit": args.rate_gbit,
        "model_bytes": model_bytes,
        "rows": rows,
        "bucket_bytes": args.bucket_mib << 20,
        "fanout": args.fanout,
        **({"rl_changed": args.changed, "delta_targets": delta_targets(rows)} if args.delta else {}),
        **({"progress_cost": progress_cost(rows)} if len(set(intervals)) > 1 else {}),
        "trainer": {"ep": args.ep, "tp": args.tp},
        "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} cores)",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    print(f"model {model_bytes / 1e6:.1f} MB, links {args.rate_gbit} Gbit/s")
    print(f"{'R':>3} {'step':>10} {'mode':>5} {'refit s':>8} {'x R=1':>6} {'trainer MB':>11} {'x R=1':>6}")
    for row in rows:
        print(
            f"{row['replicas']:>3} {row['step']:>10} {row['mode']:>5} {row['refit_s']:>8.2f} "
            f"{row['time_vs_first']:>6.2f} {row['trainer_egress_bytes'] / 1e6:>11.1f} "
            f"{row['egress_vs_first']:>6.2f}"
        )
    for target in result.get("delta_targets", []) + result.get("progress_cost", []):
        print(target)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
