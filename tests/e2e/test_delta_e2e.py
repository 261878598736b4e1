"""Delta refits end to end (real processes, syncd with delta refits on):
- a bfloat16 trainer (ep 2 x tp 2) refits two vLLM replicas after every step with a small learning
  rate, the first relaying to the second (fan-out): the first refit is full (the engines started on
  a checkpoint, no version), the next ones move only what changed, the relay forwarding the
  trainer's delta as it came; after each, both replicas' staging digests equal syncd's record and
  each other, and both generate exactly (greedy tokens and logprobs) as a separate vLLM engine on
  the trainer's export of that step;
- a trainer rank killed in the middle of a delta refit leaves the previous version served.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

LR = 1e-6  # an RL-like step: most bfloat16 weights keep their bits (2-3% change on the tiny model)
REPLICAS = 2  # of one layout: the first relays to the second (fan-out), deltas too


def test_delta_refits_generate_as_vllm_on_the_export_after_every_step(stack, model, tmp_path):
    steps = 3
    stack.start_syncd(trainers=4, db="delta.db", delta=True, generators=REPLICAS)
    replicas = [stack.start_generator(model, name=f"generator-delta-{r}", replica=r) for r in range(REPLICAS)]
    try:
        trainer = stack.train(model, pp=1, ep=2, tp=2, steps=steps, export=tmp_path / "export", lr=LR)
        served, states = [], []
        for step in range(1, steps + 1):
            stack.wait_announced(step)
            states.append(stack.refit(step))
            assert states[-1]["state"] == "COMMITTED", states[-1]
            if step == 1:  # the plan, while the trainer's ranks are registered: the first relays
                links = stack.http.get("/v1/plan").json()["links"]
                assert [(k["src"], k["dst"]) for k in links if k["relay"]] == [
                    ("generator-0-0", "generator-1-0")
                ]
            served.append([g.greedy() for g in replicas])
            _assert_replicas_hold_what_was_sent(stack, replicas, step)
        assert trainer.popen.wait(180) == 0, trainer.tail()
    finally:
        for g in replicas:
            g.proc.stop()
            stack.cluster.procs.remove(g.proc)
    assert states[0]["mode"] == "full" and states[0]["bytes"] == states[0]["planned_bytes"], states[0]
    for state in states[1:]:  # through the relay: both replicas took the trainer's delta
        assert state["mode"] == "delta" and state["delta_generators"] == ["generator-0-0", "generator-1-0"], (
            state
        )
        assert state["bytes"] < state["planned_bytes"] and 0 < state["changed_fraction"] < 0.5, state

    export = tmp_path / "export"
    reference = stack.start_generator(export / "step-1", syncd=False, name="reference-delta")
    try:
        for step in range(1, steps + 1):
            if step > 1:
                reference.load(export / f"step-{step}", version=step)
            expected = reference.greedy()
            assert all(s == expected for s in served[step - 1]), f"step {step}"
    finally:
        reference.proc.stop()
        stack.cluster.procs.remove(reference.proc)


def _assert_replicas_hold_what_was_sent(stack, replicas, version: int) -> None:
    """Each replica's staging digest (every region of the served version) equals syncd's record of
    the checksums for it, and the relayed replica's equals its relay's: the bytes are the same."""
    recorded = stack.http.get("/v1/digest").json()
    assert recorded["weight_version"] == version, recorded["weight_version"]
    workers = [w for g in replicas for w in g.http.get("/v1/weights/digest").json()]
    assert [w["member_id"] for w in workers] == [f"generator-{r}-0" for r in range(len(replicas))]
    assert all(w["available"] and w["checksums"] == recorded["members"][w["member_id"]] for w in workers)
    assert all(w["checksums"] == workers[0]["checksums"] for w in workers)


def test_a_trainer_rank_killed_mid_delta_leaves_the_previous_version_served(stack, model, tmp_path):
    # Tiny buckets stretch even a delta over many messages, so the kill lands mid-transfer.
    stack.start_syncd(trainers=2, db="delta-kill.db", bucket_bytes=512, delta=True)
    generator = stack.start_generator(model, name="generator-delta-kill")
    try:
        served: list = []
        state = stack.refit_with_a_rank_killed(
            model, tmp_path / "export", steps=2, lr=LR, committed=lambda: served.append(generator.greedy())
        )
        assert state["state"] == "ABORTED", state
        assert state["delta_generators"] == ["generator-0-0"], state  # it was a delta refit
        assert generator.greedy() == served[0]  # version 1, untouched
    finally:
        generator.proc.stop()
        stack.cluster.procs.remove(generator.proc)
