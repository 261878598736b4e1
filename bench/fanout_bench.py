"""Fan-out benchmark in the lab (`deploy/lab`): refit time and the bytes that leave the trainer's
host for R = 1, 2, 4, 8 generator replicas, every host on its own shaped link.

    sudo python -m bench.fanout_bench --json bench/results/fanout-lab-2026-11-25.json

Hosts: `syncd`, `trainer` (every trainer rank: ep x tp plain-tensor ranks of the synthetic MoE,
`bench/plain_member.py`) and `gen0` ... `gen7` (one TP-1 generator replica each, a plain member
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from bench.plain_member import loaded_marker, model_shape
from deploy.lab import Lab
from deploy.local.processes import PYTHON, Proc
from syncd.refit_wait import wait_final

HTTP_PORT, GRPC_PORT = 8470, 8471


def _members(lab: Lab, args, replicas: int, workdir: Path) -> list[Proc]:
    """syncd, the trainer ranks and `replicas` generators, each started on its lab host."""
    syncd_at = f"{lab.address('syncd')}:{GRPC_PORT}"
    procs = [
        lab.spawn(
            "syncd",
            [PYTHON, "-m", "syncd", "--host", "0.0.0.0", "--http-port", str(HTTP_PORT), "--grpc-port",
             str(GRPC_PORT), "--db", str(workdir / f"syncd-{replicas}.db"), "--bucket-bytes",
             str(args.bucket_mib << 20), "--expected-trainers", str(args.ep * args.tp),
             "--expected-generators", str(replicas), "--backend", "gloo", "--fanout", str(args.fanout),
             "--transfer-timeout", "300", "--lease-seconds", "10"],
            name=f"syncd-r{replicas}",
        )
    ]  # fmt: skip
    model = ["--model", "moe", "--mib", str(args.mib), "--syncd", syncd_at]
    ranks = [(e, t) for e in range(args.ep) for t in range(args.tp)]
    procs += [
        lab.spawn(
            "trainer",
            [PYTHON, "-m", "bench.plain_member", "--role", "trainer", *model, "--ep", str(args.ep),
             "--ep-rank", str(e), "--tp", str(args.tp), "--tp-rank", str(t),
             "--host", lab.address("trainer"), "--announce-file", str(workdir / "version")],
            name=f"trainer-{e}-{t}-r{replicas}",
        )
        for e, t in ranks
    ]  # fmt: skip
    for r in range(replicas):
        host = f"gen{r}"
        procs.append(
            lab.spawn(
                host,
                [PYTHON, "-m", "bench.plain_member", "--role", "generator", *model, "--replica", str(r),
                 "--host", lab.address(host), "--lean"],
                name=f"{host}-r{replicas}",
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


def measure(lab: Lab, args, replicas: int, workdir: Path) -> dict:
    (workdir / "version").write_text("0")
    for old in workdir.glob("version.trainer-*"):
        old.unlink()
    for old in workdir.glob(f"syncd-{replicas}.db*"):  # a fresh syncd: no history, no versions
        old.unlink()
    procs = _members(lab, args, replicas, workdir)
    http = httpx.Client(base_url=f"http://{lab.address('syncd')}:{HTTP_PORT}", timeout=30)
    try:
        _wait(http, procs, lambda: http.get("/readyz").status_code == 200, "syncd not ready", 300)
        plan = http.get("/v1/plan").json()
        times, egress = [], []
        for version in range(1, args.reps + 2):
            (workdir / "version").write_text(str(version))
            markers = [loaded_marker(workdir / "version", f"trainer-{r}") for r in range(args.ep * args.tp)]
            _wait(
                http,
                procs,
                lambda v=version, ms=markers: all(m.exists() and m.read_text() == str(v) for m in ms),
                f"version {version} not loaded by every trainer rank",
                120,
            )
            sent = lab.tx_bytes("trainer")
            r = http.post("/v1/refits", json={"weight_version": version})
            r.raise_for_status()
            record = wait_final(lambda path: http.get(path).json(), r.json()["id"], 600, poll_s=0.05)
            if record["state"] != "COMMITTED":
                raise RuntimeError(
                    f"R={replicas}: refit of version {version} {record['state']}: {record['error']}"
                )
            seconds = record["finished_at"] - record["created_at"]
            egress_bytes = lab.tx_bytes("trainer") - sent
            print(
                f"R={replicas} v{version}: {seconds:.2f} s, trainer sent {egress_bytes / 1e6:.1f} MB",
                flush=True,
            )
            if version > 1:  # the first refit negotiates the groups and allocates: a warm-up
                times.append(seconds)
                egress.append(egress_bytes)
        return {
            "replicas": replicas,
            "refit_s": round(statistics.median(times), 3),
            "trainer_egress_bytes": int(statistics.median(egress)),
            "refit_s_each": [round(t, 3) for t in times],
            "trainer_egress_bytes_each": egress,
            "plan_source_bytes": plan["source_bytes"],
            "plan_relay_bytes": plan["relay_bytes"],
        }
    finally:
        http.close()
        for p in reversed(procs):
            p.stop(grace_s=10)


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
    p.add_argument("--workdir", type=Path, default=Path("/tmp/fanout-bench"))
    args = p.parse_args()
    counts = [int(r) for r in args.replicas.split(",")]
    args.workdir.mkdir(parents=True, exist_ok=True)
    shape = model_shape("moe", args.mib)
    model_bytes = sum(c.nbytes for c in shape.canonical())
    hosts = ["syncd", "trainer", *(f"gen{r}" for r in range(max(counts)))]
    with Lab(hosts, rate_gbit=args.rate_gbit, name="fanout", logs=args.workdir / "logs") as lab:
        rows = [measure(lab, args, replicas, args.workdir) for replicas in counts]
    base = rows[0]
    for row in rows:
        row["egress_vs_first"] = round(row["trainer_egress_bytes"] / base["trainer_egress_bytes"], 3)
        row["time_vs_first"] = round(row["refit_s"] / base["refit_s"], 3)
    result = {
        "link_gbit": args.rate_gbit,
        "model_bytes": model_bytes,
        "rows": rows,
        "bucket_bytes": args.bucket_mib << 20,
        "fanout": args.fanout,
        "trainer": {"ep": args.ep, "tp": args.tp},
        "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} cores)",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    print(f"model {model_bytes / 1e6:.1f} MB, links {args.rate_gbit} Gbit/s")
    print(f"{'R':>3} {'refit s':>8} {'x R=1':>6} {'trainer MB':>11} {'x R=1':>6}")
    for row in rows:
        print(
            f"{row['replicas']:>3} {row['refit_s']:>8.2f} {row['time_vs_first']:>6.2f} "
            f"{row['trainer_egress_bytes'] / 1e6:>11.1f} {row['egress_vs_first']:>6.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
