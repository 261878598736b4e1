"""End to end across hosts: each service on its own host of a lab (`deploy/lab`: network
namespaces on a bridge, links shaped at 1 Gbit/s): syncd on `syncd`, the trainer's four ranks
(ep 2 x tp 2, gloo) on `trainer`, three vLLM CPU generator replicas (TP 1, one core each) on
`gen0`, `gen1` and `gen2`, relaying each refit in a chain (trainer -> 0 -> 1 -> 2). Every
data-plane byte crosses the lab's links (the interfaces' counters say so).

- Two refits commit, and after each every replica generates (greedy tokens and logprobs) exactly
  as vLLM on the trainer's export of that step (the session's reference engine loading it).
- The middle relay cut off (its link set down) mid-refit does not freeze the fleet: within the
  lease plus 5 s plus one refit's time the two survivors serve a new version, each equal to vLLM's
  own load of that step's export, nothing torn; once its link is back, the cut replica serves the
  newest committed version with no operator action (syncd refits each announced version itself).
- A replica killed in the middle of a refit leaves no torn weights: the refit aborts naming the
  lost member; every replica serves either what it served before or a version syncd committed
  since, equal to vLLM's own load of that step's export; and once the replica is back, the
  trainer's last step is committed on all, again equal to vLLM's own load of its export.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from e2e_harness import Generator, Stack, wait_until

from deploy.lab import placement
from deploy.lab.placement import Placement
from deploy.local.processes import Proc
from tests.lab_support import running_lab

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.timeout(1800)]

REPLICAS = 3
TRAINERS = 4  # ep 2 x tp 2
LEASE_S = 4  # the stack's syncd lease
# The cut test's trainer steps: enough that it still trains (holds weights to refit) when the cut
# replica is back on the network.
CUT_STEPS = 12
# The fault tests' trainer takes a step more than the refits before and during the fault need: its
# version after the one syncd's retry over the survivors may commit is still to move to both
# replicas once the lost one is back (a trainer holds only its newest weights).
FAULT_STEPS = 3
# How a trainer rank refuses a refit of a version it no longer holds (trainer_svc.agent).
TRAINER_MOVED_ON = "but this rank holds version"
CRAWL_GBIT = (
    0.002  # a replica's link during a failure test: ~9 s for its 2.24 MB, so the cut lands mid-transfer
)


@pytest.fixture(scope="module")
def lab_stack(tmp_path_factory):
    work = tmp_path_factory.mktemp("lab-e2e")
    with running_lab(placement.hosts(REPLICAS), "e2e", work / "logs") as lab:
        stack = Stack(work, Placement(lab))
        try:
            yield stack, lab
        finally:
            stack.stop()


@pytest.fixture(scope="module")
def replicas(lab_stack, model) -> dict[int, Generator]:
    """The generator replicas, each bound to a core (replica r on core r mod the cores)."""
    stack, _ = lab_stack
    stack.start_syncd(trainers=TRAINERS, generators=REPLICAS, db="first.db")
    return {r: start_replica(stack, model, r) for r in range(REPLICAS)}


@pytest.fixture
def train(lab_stack, model):
    """Start this test's trainer job (`steps`, exporting to `export`); the e2e conftest stops it
    when the test ends, passed or failed."""
    stack, _ = lab_stack

    def start(steps: int, export: Path) -> Proc:
        return stack.train(model, pp=1, ep=2, tp=2, steps=steps, export=export)

    return start


def start_replica(stack: Stack, model: Path, replica: int) -> Generator:
    return stack.start_generator(
        model, replica=replica, name=f"generator-{replica}", cpus=str(replica % (os.cpu_count() or 1))
    )


def test_two_refits_across_hosts_generate_as_vllm_on_the_trainers_export(
    lab_stack, replicas, train, references, tmp_path
):
    stack, lab = lab_stack
    export = tmp_path / "export"
    trainer = train(2, export)
    served: dict[int, list] = {r: [] for r in replicas}
    for step in (1, 2):
        stack.wait_announced(step)
        egress_before = lab.tx_bytes(placement.TRAINER)
        received_before = {r: lab.rx_bytes(placement.generator_host(r)) for r in replicas}
        state = stack.refit(step)
        assert state["state"] == "COMMITTED", state
        # What each replica received (syncd's count is over both) reached its host over the lab's
        # links, not over a loopback, and left the trainer's host once: the two replicas have one
        # layout, so the second receives from the first (fan-out) instead of from the trainer.
        one_copy = state["bytes"] // REPLICAS
        egress = lab.tx_bytes(placement.TRAINER) - egress_before
        assert one_copy <= egress < 1.5 * one_copy, (egress, one_copy)
        for r in replicas:
            assert lab.rx_bytes(placement.generator_host(r)) - received_before[r] >= one_copy
            served[r].append(replicas[r].greedy())
    assert trainer.popen.wait(180) == 0, trainer.tail()

    for step in (1, 2):
        expected = references.greedy(export / f"step-{step}")
        assert all(served[r][step - 1] == expected for r in replicas), f"step {step}"


def test_the_middle_relay_cut_off_mid_refit_the_survivors_move_on_and_it_catches_up(
    lab_stack, replicas, train, tmp_path
):
    stack, lab = lab_stack
    stack.start_syncd(
        trainers=TRAINERS, generators=REPLICAS, db="link-down.db", lease_seconds=LEASE_S, auto_refit=True
    )
    export = tmp_path / "export"
    survivors = {r: g for r, g in replicas.items() if r != 1}
    lab.set_rate("gen1", CRAWL_GBIT)  # the first refit crawls through the middle relay
    trainer = train(CUT_STEPS, export)
    try:
        first = transferring(stack)
        lab.link_down("gen1")
        cut_at = time.monotonic()
        aborted = stack.wait_refit(first["id"], timeout_s=120)
        assert aborted["state"] == "ABORTED" and "generator-1-0" in aborted["error"], aborted
        moved = wait_until(lambda: moved_on(stack, survivors), 120, "the survivors to serve a new version")
        took = time.monotonic() - cut_at
        # The bound: the lease, 5 s, and the time of the refit that brought the survivors their
        # version (it went on without the cut replica).
        assert took <= LEASE_S + 5 + refit_seconds(moved), (took, moved)
        served = {r: served_now(g) for r, g in survivors.items()}  # checked against the export below
    finally:
        lab.link_up("gen1")
        lab.set_rate("gen1", 1.0)
    # No operator action from here: the replica registers again behind, and syncd's refits of the
    # trainer's next steps (or its catch-up refit) reach it.
    assert trainer.popen.wait(600) == 0, trainer.tail()
    stack.wait_idle(timeout_s=300)
    committed = stack.http.get("/v1/status").json()["committed_version"]
    assert committed == CUT_STEPS, committed
    labels = {r: g.http.get("/v1/weight_version").json()["version"] for r, g in replicas.items()}
    assert labels == {r: str(CUT_STEPS) for r in replicas}, labels
    served[1] = served_now(replicas[1])
    # Nothing torn: what each served equals vLLM's own load of that step's export.
    for r, (version, got) in served.items():
        assert int(version) >= moved["weight_version"], (r, version)
        replicas[1].load(export / f"step-{version}", version=9000 + int(version))
        assert got == replicas[1].greedy(), f"replica {r} served version {version} torn"


def transferring(stack: Stack) -> dict:
    """The refit syncd started by itself, once it is transferring."""

    def current() -> dict | None:
        refit = stack.http.get("/v1/status").json()["current_refit"]
        return refit if refit is not None and refit["state"] == "TRANSFERRING" else None

    return wait_until(current, 180, "syncd's refit of the first step to transfer")


def moved_on(stack: Stack, survivors: dict[int, Generator]) -> dict | None:
    """The refit of this syncd (a fresh store) that committed without the cut replica, once every
    survivor serves its version."""
    status = stack.http.get("/v1/status").json()
    committed = status["committed_version"]
    if committed is None:
        return None
    labels = {g.http.get("/v1/weight_version").json()["version"] for g in survivors.values()}
    if labels != {str(committed)}:
        return None
    refits = stack.http.get("/v1/refits").json()["refits"]
    return next(
        (
            r
            for r in refits
            if r["state"] == "COMMITTED"
            and r["weight_version"] == committed
            and "generator-1-0" in r["left_out"]
        ),
        None,
    )


def refit_seconds(refit: dict) -> float:
    return refit["finished_at"] - refit["created_at"]


def test_a_replica_killed_mid_refit_leaves_no_torn_weights_and_the_next_refit_commits(
    lab_stack, replicas, model, train, tmp_path
):
    stack, lab = lab_stack
    stack.start_syncd(trainers=TRAINERS, generators=REPLICAS, db="kill.db")
    before = {r: served_now(g) for r, g in replicas.items()}
    trainer = train(FAULT_STEPS, tmp_path / "export")
    lab.set_rate("gen1", CRAWL_GBIT)
    killed = replicas[1].proc
    try:
        state = refit_with_a_fault(stack, 1, lambda: os.killpg(killed.popen.pid, signal.SIGKILL))
    finally:
        lab.set_rate("gen1", 1.0)
    stack.cluster.discard(killed)  # reaps what is left
    # The abort names the lost replica by the address its trainer peers lost (gloo's error).
    check_no_torn_weights(
        stack,
        state,
        {r: g for r, g in replicas.items() if r != 1},
        before,
        tmp_path / "export",
        lost=("generator-1-0", lab.address("gen1")),
    )
    replicas[1] = start_replica(stack, model, 1)  # back, on the checkpoint it starts from
    after_refit_recovers(stack, replicas, trainer, tmp_path / "export")


def refit_with_a_fault(stack: Stack, version: int, fault) -> dict:
    """Trigger a refit of `version`, run `fault()` once it is transferring, return its outcome."""
    stack.wait_announced(version)
    stack.wait_ready()
    r = stack.http.post("/v1/refits", json={"weight_version": version})
    assert r.status_code == 202, r.text
    refit_id = r.json()["id"]
    wait_until(
        lambda: stack.http.get(f"/v1/refits/{refit_id}").json()["state"] == "TRANSFERRING",
        120,
        "the transfer to start",
    )
    fault()
    return stack.wait_refit(refit_id, timeout_s=300)


def served_now(generator: Generator) -> tuple[str, dict]:
    """The version label a replica serves and its greedy completions, read while no install came
    between them: after a fault syncd's retry over the survivors may commit at any moment (CI once
    read the old label, then completions of the version committed just after)."""
    for _ in range(10):
        label = generator.http.get("/v1/weight_version").json()["version"]
        got = generator.greedy()
        if generator.http.get("/v1/weight_version").json()["version"] == label:
            return label, got
    raise AssertionError(f"{generator.proc.name} changed version during each of 10 reads")


def check_no_torn_weights(
    stack: Stack,
    state: dict,
    reachable: dict[int, Generator],
    before: dict,
    export: Path,
    lost: tuple[str, ...],
) -> None:
    """Every reachable replica serves a whole version: what it served before (`before`: label and
    greedy completions), or a version syncd committed without the lost member (a re-route, or its
    retry over the survivors once the lost lease ran out: the aborted version or, if the trainer
    trained on meanwhile, a newer one); then it generates as vLLM's own load of that step's
    export. An abort names the lost member (one of `lost`: its id, or its address)."""
    assert state["state"] in ("ABORTED", "COMMITTED"), state
    if state["state"] == "ABORTED":
        assert any(name in (state.get("error") or "") for name in lost), state
    for r, generator in reachable.items():
        check_serves_a_whole_version(stack, generator, before[r], export)


def check_serves_a_whole_version(
    stack: Stack, generator: Generator, before: tuple[str, dict], export: Path, moved: bool = False
) -> None:
    """What it served before, unchanged (unless `moved`), or the version this syncd (a fresh store
    per test) committed since, equal to vLLM's own load of that step's export. (A label alone could
    be an earlier test's run's, so an unchanged replica is told by its completions.)"""
    version, got = served_now(generator)
    if (version, got) == before:
        assert not moved, f"{generator.proc.name} still serves what it served before"
        return
    committed = stack.http.get("/v1/status").json()["committed_version"]
    assert version == str(committed), f"{generator.proc.name} serves {version}, neither before nor committed"
    generator.load(export / f"step-{version}", version=9000 + int(version))
    assert got == generator.greedy(), f"{generator.proc.name} serves version {version} torn"


def after_refit_recovers(stack: Stack, replicas: dict[int, Generator], trainer, export: Path) -> None:
    """With every replica back, the trainer's remaining steps are refitted until its last one is
    served by both; both then generate as vLLM's own load of that step's export.

    syncd may move versions by itself meanwhile: its retry over the survivors (the aborted version,
    or a newer one if the trainer trained on during the settle time) and its catch-up of the
    replica that came back. So each round waits until no refit runs, then refits the newest
    announced version unless every replica serves it already (a 409: syncd started one first). Ours
    aborts when syncd's retry committed that version meanwhile and the trainer stepped on (CI saw
    it): the next round refits the newer one."""
    deadline = time.monotonic() + 900

    def committed_everywhere(version: int) -> bool:
        """This syncd (a fresh store per test) committed `version`, and every replica serves it
        (a label alone could be an earlier test's run's)."""
        labels = {g.http.get("/v1/weight_version").json()["version"] for g in replicas.values()}
        return stack.http.get("/v1/status").json()["committed_version"] == version and labels == {
            str(version)
        }

    while not committed_everywhere(FAULT_STEPS):
        assert time.monotonic() < deadline, f"version {FAULT_STEPS} not committed on every replica"
        stack.wait_idle(timeout_s=300)
        announced = stack.http.get("/v1/status").json()["announced_version"]
        if committed_everywhere(announced):
            stack.wait_announced(announced + 1, timeout_s=300)
            continue
        r = stack.http.post("/v1/refits", json={"weight_version": announced})
        if r.status_code == 409:
            continue  # syncd's own refit began first, or the trainer announced a newer version
        assert r.status_code == 202, r.text
        state = stack.wait_refit(r.json()["id"], timeout_s=300)
        if state["state"] == "ABORTED" and TRAINER_MOVED_ON in (state["error"] or ""):
            continue  # syncd's retry committed `announced` and the trainer stepped on before ours began
        assert state["state"] == "COMMITTED", state
    assert trainer.popen.wait(180) == 0, trainer.tail()
    greedy = {r: g.greedy() for r, g in replicas.items()}
    assert all(g == greedy[0] for g in greedy.values())
    replicas[1].load(export / f"step-{FAULT_STEPS}", version=9000 + FAULT_STEPS)
    assert greedy[1] == replicas[1].greedy()
