"""Version digests (`syncd.daemon.digests`) and a worker's digest of what staging holds
(`generator_svc.worker.digest`): they agree after a refit, and a byte changed in staging afterwards is
named by tensor and region."""

from __future__ import annotations

import threading

import pytest
import torch

from generator_svc.worker.digest import ServedRegions
from syncd.daemon.digests import Digests, VersionDigest, compare, digest_of
from syncd.daemon.errors import NotFound
from syncd.daemon.store import Store
from syncd.layout import Canon, Catalog, local_tensor
from syncd.member.dataplane import catalog_views, pack_into, unpack_from
from syncd.member.dataplane.checksum import Checksums
from syncd.member.dataplane.prepared import PreparedBucket
from syncd.plan import DestMember, SourceMember, make_plan
from syncd.vocabulary import Direction
from tests.unit.test_dataplane_gloo import ALL, vllm_catalog


def _refit(dtype: str):
    """A float32 trainer's refit of a `dtype` TP-2 worker (rank 0) through the packing code,
    no transport: the senders' checksums per member and the worker's staging."""
    whole = Catalog(ALL, tuple(local_tensor(c.name, "float32", Canon(c.name, c.shape)) for c in ALL))
    dest = vllm_catalog(0, 2, dtype)
    plan = make_plan(
        [SourceMember("trainer-0", 0, whole)], [DestMember("generator-0-0", dest)], bucket_bytes=256
    )
    gen = torch.Generator().manual_seed(0)
    source = {t.name: torch.randn(t.shape, generator=gen) for t in whole.tensors}
    staging = {t.name: torch.zeros(t.shape, dtype=getattr(torch, dtype)) for t in dest.tensors}
    views = catalog_views(dest, staging)
    sent = Checksums()
    for b in plan.buckets:
        flat = pack_into(b, source, torch.empty(b.nbytes, dtype=torch.uint8))
        PreparedBucket(Direction.SEND, b, source, flat).checksum(sent)
        unpack_from(b, flat, views)
    return plan, {"trainer-0": sent.result()}, views


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_workers_digest_equals_the_senders_until_a_byte_of_staging_changes(dtype: str) -> None:
    plan, checksums, staging = _refit(dtype)
    recorded = VersionDigest("run-a", 1, digest_of(plan, checksums))
    served = ServedRegions()
    assert not served.digest(staging, "generator-0-0").available
    served.receiving("refit-1", plan.buckets, "generator-0-0")
    assert not served.digest(staging, "generator-0-0").available  # not applied yet
    served.applied("1")
    mine = served.digest(staging, "generator-0-0")
    assert mine.available and mine.version == "1"
    assert len(mine.checksums) == sum(len(b.units) for b in plan.buckets)
    assert compare(recorded, "generator-0-0", mine.checksums) == []

    staging["w13_weight"].view(-1)[5] += 1  # outside a refit: no checksum of the data plane sees it
    (difference,) = compare(recorded, "generator-0-0", served.digest(staging, "generator-0-0").checksums)
    assert difference.tensor == "m.experts.gate_proj.weight" and difference.region.startswith(
        difference.tensor + "["
    )
    assert difference.expected == recorded.members["generator-0-0"][difference.region] != difference.got

    served.receiving("refit-2", plan.buckets, "generator-0-0")
    assert served.digest(staging, "generator-0-0").reason == (
        "refit refit-2 wrote staging after the served version was installed"
    )


def test_digests_keep_the_committed_version_across_a_restart_and_name_what_they_lack(tmp_path) -> None:
    plan, checksums, _ = _refit("float32")
    store = Store(str(tmp_path / "syncd.db"))
    digests = Digests(store)
    with pytest.raises(NotFound, match="no version committed yet"):
        digests.get()
    digests.committed(VersionDigest("run-a", 3, digest_of(plan, checksums)))
    for t in threading.enumerate():  # the store write runs off the caller's thread
        if t.name == "digest-store":
            t.join(30)
    store.close()
    again = Digests(Store(str(tmp_path / "syncd.db")))
    assert again.get().weight_version == 3 and again.get(3).members == digest_of(plan, checksums)
    with pytest.raises(NotFound, match="no digest of version 2; digests kept of versions: 3"):
        again.get(2)
    with pytest.raises(NotFound, match="was not committed to generator-9-0; its members: generator-0-0"):
        compare(again.get(), "generator-9-0", {})
