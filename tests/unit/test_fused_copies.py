"""`fused.FusedCopies`: a copy that hashes what it wrote chunk by chunk writes the same bytes and
computes the same checksums as the copy followed by the hash (`pack.copy_pairs`,
`Checksums.add`, `landed.landed_checksums`), whatever the chunking."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from syncd.commands import checksum_key
from syncd.member.dataplane import catalog_views, fused
from syncd.member.dataplane.checksum import Checksums
from syncd.member.dataplane.fused import FusedCopies
from syncd.member.dataplane.landed import landed_checksums
from syncd.member.dataplane.pack import copy_pairs
from syncd.plan import DestMember, SourceMember, make_plan
from syncd.plan.simulate import materialize
from syncd.vocabulary import Direction
from tests.unit.test_dataplane_gloo import ALL, trainer_catalog, vllm_catalog


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 256, 40], ids=["whole", "rows", "row-each"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_pack_and_unpack_equal_the_copy_then_the_hash(
    monkeypatch: pytest.MonkeyPatch, chunk_bytes: int, dtype: str
) -> None:
    monkeypatch.setattr(fused, "CHUNK_BYTES", chunk_bytes)
    rng = np.random.default_rng(3)
    canonical = {c.name: rng.standard_normal(c.shape).astype(np.float32) for c in ALL}
    sources = [
        SourceMember(f"trainer-{e * 2 + t}", 0, trainer_catalog(e, t)) for e in range(2) for t in range(2)
    ]
    dest = DestMember("generator-0-0", vllm_catalog(0, 2, dtype))
    plan = make_plan(sources, [dest], bucket_bytes=512)
    sent = {
        s.member_id: catalog_views(
            s.catalog, {k: torch.from_numpy(v) for k, v in materialize(s.catalog, canonical).items()}
        )
        for s in sources
    }
    fused_into = {t.name: torch.zeros(t.shape, dtype=getattr(torch, dtype)) for t in dest.catalog.tensors}
    copied_into = {k: v.clone() for k, v in fused_into.items()}
    for bucket in plan.for_member(dest.member_id):
        flat, reference = (torch.zeros(bucket.nbytes, dtype=torch.uint8) for _ in range(2))
        fused_sums, reference_sums = Checksums(), Checksums()
        FusedCopies.pack(bucket, sent[bucket.src], flat).run(fused_sums)
        copy_pairs(Direction.SEND, bucket, sent[bucket.src], reference).run()
        offset = 0
        for u in bucket.units:
            reference_sums.add(checksum_key(u.canonical, u.canon), reference[offset : offset + u.nbytes])
            offset += u.nbytes
        assert torch.equal(flat, reference)
        assert fused_sums.result() == reference_sums.result()

        landed = Checksums()
        scratch = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        FusedCopies.unpack(bucket, catalog_views(dest.catalog, fused_into), flat, scratch).run(landed)
        copy_pairs(Direction.RECV, bucket, catalog_views(dest.catalog, copied_into), flat).run()
        assert landed.result() == landed_checksums(bucket.units, catalog_views(dest.catalog, copied_into))
        assert landed.result() == fused_sums.result()  # what landed is what was packed
    assert all(torch.equal(fused_into[k], copied_into[k]) for k in fused_into)
