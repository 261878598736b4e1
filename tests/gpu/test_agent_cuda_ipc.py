"""Two member agents (a trainer rank and a vLLM-shaped receiver) in two processes, driven by the
commands syncd sends to a CUDA IPC group: JoinGroup with CUDA IPC links (no NCCL communicator:
NCCL refuses two ranks on one GPU) and ExecutePlan naming the links CUDA IPC carries.

- Two refits, the second after the trainer rewrote its weights in place: every tensor lands
  bit-exact and both agents report the same checksum for every unit, as syncd compares them; on
  one GPU, and with the receiver on a second GPU that reads the first's memory (peer access).
- A receiver gone after the join fails the trainer's refit at once, naming the receiver.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from syncd.net import free_port

pytestmark = pytest.mark.gpu(count=1)

MEMBERS = ("trainer-0", "generator-0-0")
GROUP = "refit-0/stage0"


class _Reporter:
    def __init__(self, member_id: str, store: dist.Store) -> None:
        self.member_id, self._store = member_id, store
        self.reports: list[tuple[str, str, dict]] = []

    def report(self, refit_id: str, phase: str, *, address: str = "", checksums=None, **_) -> None:
        self.reports.append((refit_id, phase, dict(checksums or {})))
        if phase == "GROUP_ADDRESS":
            self._store.set("address", address)


class _Endpoint:
    def __init__(self, views) -> None:
        self.views = views

    def begin(self, refit_id, weight_version, buckets):
        return self.views

    def end(self, refit_id, ok) -> None: ...
    def verify(self, refit_id) -> None: ...
    def commit(self, refit_id, weight_version, timeout_s) -> None: ...
    def abort(self) -> None: ...


def _member(rank: int, port: int, mode: str, devices: tuple[str, str]) -> None:
    from syncd.commands import ExecutePlan, JoinGroup, StageGroup
    from syncd.member.agent import AgentSettings, MemberAgent
    from syncd.member.dataplane import catalog_views
    from syncd.plan import DestMember, SourceMember, make_plan
    from syncd.plan.simulate import materialize
    from testkit.synthetic_moe import trainer_catalog, vllm_catalog
    from tests.gpu.small_moe import SMALL_MOE, canonical

    device = devices[rank]
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    src_cat, dst_cat = trainer_catalog(SMALL_MOE, 1, 0, 1, 0), vllm_catalog(SMALL_MOE, 1, 0)
    plan = make_plan(
        [SourceMember(MEMBERS[0], 0, src_cat)], [DestMember(MEMBERS[1], dst_cat)], bucket_bytes=1 << 20
    )
    weights = canonical(7)
    me = MEMBERS[rank]
    if rank == 0:
        owned = {k: torch.from_numpy(v).to(device) for k, v in materialize(src_cat, weights).items()}
        views = catalog_views(src_cat, owned)
    else:
        owned = {t.name: torch.full(t.shape, float("nan"), device=device) for t in dst_cat.tensors}
        views = catalog_views(dst_cat, owned)
    reporter = _Reporter(me, store)
    agent = MemberAgent(reporter, _Endpoint(views), AgentSettings(device=device, pause_gc=False))
    if rank == 0:
        address = ""  # rank 0 creates it and reports it (`_Reporter` posts it for rank 1)
    else:
        store.wait(["address"])
        address = store.get("address").decode()
    agent(JoinGroup("refit-0", GROUP, 0, rank, 2, "nccl", address, MEMBERS, 60.0, ("cuda_ipc", "cuda_ipc")))
    result: dict = {"joined": True}
    if mode == "receiver-gone" and rank == 1:
        store.set(f"result/{me}", json.dumps(result))
        os._exit(0)  # no Execute, no close: as a killed process
    links = frozenset((b.stage, b.src, b.dst) for b in plan.buckets)
    group = (StageGroup(0, GROUP, "nccl", MEMBERS),)
    refits = (1,) if mode == "receiver-gone" else (1, 2)
    for version in refits:
        if version == 2 and rank == 0:
            for t in owned.values():
                t.add_(1.0)  # in place: the receiver's mappings stay valid
        cmd = ExecutePlan(f"refit-{version}", version, plan.for_member(me), group, 60.0, ipc_links=links)
        try:
            agent(cmd)
        except Exception as e:  # noqa: BLE001 - what the member would report, for the test to read
            result[f"error{version}"] = str(e)
            continue
        (sums,) = [c for r, p, c in reporter.reports if r == cmd.refit_id and p == "TRANSFERRED"]
        result[f"sums{version}"] = sums
        if rank == 1:
            torch.cuda.synchronize()
            shifted = {k: v + (version - 1) for k, v in weights.items()}
            expected = materialize(dst_cat, shifted)
            result[f"bad{version}"] = [
                n for n, t in owned.items() if not np.array_equal(t.cpu().numpy(), expected[n])
            ]
    result["units"] = plan.num_units
    result["tensors"] = sorted(owned)
    agent.close()
    store.set(f"result/{me}", json.dumps(result))


def _run(mode: str, devices: tuple[str, str] = ("cuda:0", "cuda:0")) -> dict:
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_member, args=(r, port, mode, devices)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=180)
    finally:
        for p in procs:
            p.kill()
    return {m: json.loads(store.get(f"result/{m}")) if store.check([f"result/{m}"]) else {} for m in MEMBERS}


def _two_refits_land_exactly(devices: tuple[str, str]) -> None:
    got = _run("refits", devices)
    sender, receiver = got["trainer-0"], got["generator-0-0"]
    assert "error1" not in sender and "error1" not in receiver, got
    for version in (1, 2):
        assert receiver[f"bad{version}"] == [], (version, receiver)
        assert len(sender[f"sums{version}"]) == sender["units"], version
        assert sender[f"sums{version}"] == receiver[f"sums{version}"], version
    assert sender["sums1"] != sender["sums2"]  # the second refit moved new weights
    names = " ".join(receiver["tensors"])
    assert "qkv_proj" in names and "w13_weight" in names and "w2_weight" in names


def test_two_refits_through_cuda_ipc_land_exactly_with_agreeing_checksums():
    _two_refits_land_exactly(("cuda:0", "cuda:0"))


@pytest.mark.gpu(count=2)
def test_the_receiver_on_another_gpu_of_the_host_reads_the_senders_memory_through_peer_access():
    _two_refits_land_exactly(("cuda:0", "cuda:1"))


def test_a_receiver_gone_after_the_join_fails_the_senders_refit_naming_it():
    got = _run("receiver-gone")
    assert got["generator-0-0"] == {"joined": True}, got
    error = got["trainer-0"].get("error1", "")
    assert "generator-0-0" in error and "failed or is gone" in error, got
