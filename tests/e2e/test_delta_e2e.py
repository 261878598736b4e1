"""Delta refits end to end (real processes, syncd with delta refits on):
- a bfloat16 trainer (ep 2 x tp 2) refits two vLLM replicas after every step with a small learning
  rate, the first relaying to the second (fan-out): the first refit is full (the engines started on
  a checkpoint, no version), the next ones move only what changed, the relay forwarding the
  trainer's delta as it came; after each, both replicas' staging digests equal syncd's record and
  each other, and both generate exactly (greedy tokens and logprobs) as a separate vLLM engine on
  the trainer's export of that step;
- a trainer rank killed in the middle of a delta refit leaves the previous version served;
- an inplace generator (`--inplace-delta-base`, syncd `--delta-inplace`) takes deltas into its live
  layers: a delta equals vLLM on the export, and a delta that fails after its first write (its
  base corrupted, caught by the whole-region checksum; a trainer rank killed mid-transfer) is
  rolled back from the undo log: the previous version serves on, equal to vLLM on its export.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
import torch
from e2e_harness import Generator, rank_pids
from safetensors.torch import load_file

from tests.generator.process_memory import count_everywhere, descendants, flip_everywhere
from tests.polling import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

LR = 1e-6  # an RL-like step: most bfloat16 weights keep their bits (2-3% change on the tiny model)
REPLICAS = 2  # of one layout: the first relays to the second (fan-out), deltas too


def test_delta_refits_generate_as_vllm_on_the_export_after_every_step(stack, model, references, tmp_path):
    steps = 3
    # A lease longer than the harness's 4 s. Once, in a loaded suite, a replica's first request
    # (when vLLM compiles its logprobs kernel) took 8.6 s, its lease ran out, and it re-registered
    # and rightly took the next refit in full. This test is about the deltas, not leases.
    stack.start_syncd(trainers=4, db="delta.db", delta=True, generators=REPLICAS, lease_seconds=15)
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
            stack.cluster.discard(g.proc)
    assert states[0]["mode"] == "full" and states[0]["bytes"] == states[0]["planned_bytes"], states[0]
    for state in states[1:]:  # through the relay: both replicas took the trainer's delta
        assert state["mode"] == "delta" and state["delta_generators"] == ["generator-0-0", "generator-1-0"], (
            state
        )
        assert state["bytes"] < state["planned_bytes"] and 0 < state["changed_fraction"] < 0.5, state

    export = tmp_path / "export"
    for step in range(1, steps + 1):
        expected = references.greedy(export / f"step-{step}")
        assert all(s == expected for s in served[step - 1]), f"step {step}"


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
        stack.cluster.discard(generator.proc)


# A weight of a layer vLLM post-processes (CPU: the MoE prepack, which interleaves rows), so the
# inplace generator keeps its checkpoint-format copy, the delta base, beside the packed tensors it
# serves from: a row of it in checkpoint order is in the generator's memory only in that copy.
PROCESSED = "model.layers.1.mlp.experts.0.gate_proj.weight"


def _unchanged_row(export: Path, before: int, after: int) -> bytes:
    """The first 16 values of a row of PROCESSED whose first value the step `after` leaves as it
    was at step `before`: flipping it in the generator's base is a corruption no delta repairs."""
    old = load_file(str(export / f"step-{before}" / "model.safetensors"))[PROCESSED]
    new = load_file(str(export / f"step-{after}" / "model.safetensors"))[PROCESSED]
    assert old.dtype == torch.bfloat16
    same = (old[:, 0].view(torch.int16) == new[:, 0].view(torch.int16)).nonzero()
    return old[int(same[0]), :16].contiguous().view(torch.uint8).numpy().tobytes()


def _rollbacks(generator: Generator) -> list[int]:
    """For each in-place delta rollback the generator logged: how many of its undone writes had
    changed bits (0: the refit failed before the delta wrote anything)."""
    text = generator.proc.log.read_text(errors="replace")
    return [
        int(n) for n in re.findall(r"in-place delta rolled back .*? (\d+) of them had changed bits", text)
    ]


def _changed_expert_row(export: Path, before: int, after: int) -> bytes:
    """16 values, at step `after`, of a row of expert 0 (trainer rank 0 holds it: ep 2) that
    differ from step `before`: in the generator's memory only once rank 0's delta was applied."""
    name = "model.layers.0.mlp.experts.0.gate_proj.weight"
    old = load_file(str(export / f"step-{before}" / "model.safetensors"))[name][:, :16]
    new = load_file(str(export / f"step-{after}" / "model.safetensors"))[name][:, :16]
    changed = (old.view(torch.int16) != new.view(torch.int16)).any(1).nonzero()
    return new[int(changed[0])].contiguous().view(torch.uint8).numpy().tobytes()


def _rank(pids: list[int], rank: int) -> int:
    """The pid of trainer rank `rank` among a torchrun job's ranks (torchrun sets RANK)."""
    for pid in pids:
        if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            return pid
    raise AssertionError(f"no trainer rank {rank} among {pids}")


def _kill_second_sender_once_the_first_wrote(stack, generator: Generator, trainer, version: int, row: bytes):
    """Refit `version` and, while it transfers, stop trainer rank 1 (the generator receives
    rank 0's link first, then waits for rank 1's); once rank 0's changes are in the generator's
    memory, kill rank 1 (torchrun then ends rank 0). Returns the refit's final state."""
    stack.wait_ready()
    r = stack.http.post("/v1/refits", json={"weight_version": version})
    assert r.status_code == 202, r.text
    refit_id = r.json()["id"]

    def state() -> str:
        return stack.http.get(f"/v1/refits/{refit_id}").json()["state"]

    wait_until(lambda: state() == "TRANSFERRING", 60, "the transfer to start")
    second = _rank(rank_pids(trainer.popen.pid), 1)
    os.kill(second, signal.SIGSTOP)
    try:
        wait_until(
            lambda: (
                state() != "TRANSFERRING"
                or sum(count_everywhere(p, row) for p in descendants(generator.proc.popen.pid)) > 0
            ),
            60,
            "rank 0's delta in the generator's memory",
        )
    finally:
        os.kill(second, signal.SIGKILL)
    return stack.wait_refit(refit_id)


def test_inplace_deltas_commit_exactly_and_a_failed_one_leaves_the_previous_version(
    stack, model, references, tmp_path
):
    """One inplace generator, one trainer job (ep 2) of five steps: 1 full; 2 a delta (equal to
    vLLM on export 2); 3 a delta onto a base flipped from outside (one bit of the kept copy of a
    processed weight): the whole-region checksum aborts it after the delta was written, the undo
    log restores it, and version 2 serves on; 4 full (the base was lost); 5 a delta whose second
    sender is killed after the first sender's link was written: rolled back, version 4 serves on."""
    if os.geteuid() != 0:
        pytest.skip("changing another process's memory needs root")
    # A lease longer than the time the test holds a trainer rank stopped (SIGSTOP) mid-transfer.
    stack.start_syncd(
        trainers=2, db="delta-inplace.db", bucket_bytes=512, delta=True, delta_inplace=True, lease_seconds=30
    )
    generator = stack.start_generator(
        model, name="generator-delta-inplace", refit_mode="inplace", inplace_delta_base=True
    )
    export = tmp_path / "export"
    served: dict[str, object] = {}
    try:
        trainer = stack.train(model, pp=1, ep=2, tp=1, steps=5, export=export, lr=LR)
        stack.wait_announced(1)
        assert stack.refit(1)["mode"] == "full"
        stack.wait_announced(2)
        state = stack.refit(2)
        assert state["state"] == "COMMITTED" and state["delta_generators"] == ["generator-0-0"], state
        served["2"] = generator.greedy()

        stack.wait_announced(3)
        pattern = _unchanged_row(export, 2, 3)
        try:
            flipped = sum(flip_everywhere(pid, pattern) for pid in descendants(generator.proc.popen.pid))
        except PermissionError as e:  # root without CAP_SYS_PTRACE, or Yama's ptrace_scope 3
            pytest.skip(f"this machine forbids writing another process's memory: {e}")
        assert flipped == 1, f"{flipped} copies of the kept base row in the generator's memory"
        state = stack.refit(3)
        assert state["state"] == "ABORTED" and state["delta_generators"] == ["generator-0-0"], state
        grouped = "model.layers.1.mlp.experts.gate_proj.weight region [0:1,"  # syncd's name: experts grouped
        assert f"checksum mismatch for tensor {grouped}" in (state["error"] or ""), state
        served["3 aborted"] = generator.greedy()  # serving, not refused: the delta was rolled back
        assert len(_rollbacks(generator)) == 1 and _rollbacks(generator)[0] > 0, generator.proc.tail()

        stack.wait_announced(4)  # the trainer steps on after the abort
        state = stack.refit(4)
        assert state["state"] == "COMMITTED" and state["mode"] == "full", state
        served["4"] = generator.greedy()

        stack.wait_announced(5)
        state = _kill_second_sender_once_the_first_wrote(
            stack, generator, trainer, 5, _changed_expert_row(export, 4, 5)
        )
        trainer.stop()
        assert state["state"] == "ABORTED" and state["delta_generators"] == ["generator-0-0"], state
        served["5 aborted"] = generator.greedy()
        assert len(_rollbacks(generator)) == 2 and _rollbacks(generator)[1] > 0, generator.proc.tail()
    finally:
        stack.cluster.discard(generator.proc)
    expected = references.greedy(export / "step-2")
    assert served["2"] == expected, "the delta to version 2"
    assert served["3 aborted"] == expected, "version 2 after the delta onto a corrupted base"
    expected = references.greedy(export / "step-4")
    assert served["4"] == expected, "the full refit to version 4"
    assert served["5 aborted"] == expected, "version 4 after the delta with a sender killed"
