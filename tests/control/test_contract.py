"""The gRPC contract: checked-in stubs match proto/, and messages convert losslessly."""

from __future__ import annotations

from pathlib import Path

from syncd_harness import generator_catalog

from syncd.api import convert, generate
from syncd.api import syncd_pb2 as pb
from syncd.commands import Abort, Commit, ExecutePlan, JoinGroup, StageGroup, Verify, checksum_key
from syncd.layout import Box
from syncd.plan.types import Bucket, TransferUnit


def test_checked_in_stubs_are_fresh(tmp_path: Path) -> None:
    for fresh in generate.generate(tmp_path):
        checked_in = generate.API_DIR / fresh.name
        assert checked_in.read_text() == fresh.read_text(), (
            f"{checked_in} is stale: run `python -m syncd.api.generate` (make proto)"
        )


def test_enums_start_unspecified() -> None:
    for enum in pb.DESCRIPTOR.enum_types_by_name.values():
        assert enum.values_by_number[0].name.endswith("_UNSPECIFIED"), enum.name
    assert pb.DESCRIPTOR.package == "weightsync.v1"


def test_catalog_and_commands_round_trip() -> None:
    catalog = generator_catalog(1)
    wire = convert.catalog_to_pb(catalog).SerializeToString()
    decoded = convert.catalog_from_pb(pb.Catalog.FromString(wire))
    assert decoded == catalog and decoded.content_hash == catalog.content_hash

    unit = TransferUnit(
        "w", Box((0, 2), (4, 6)), "bfloat16", "w", Box((0, 0), (4, 4)), "w_local", Box((1, 0), (5, 4)), 32
    )
    bucket = Bucket(stage=1, src="trainer-1", dst="generator-0-0", index=3, units=(unit,), nbytes=32)
    group = StageGroup(1, "refit-1/stage1", "gloo", ("trainer-1", "generator-0-0"))
    for cmd in (
        JoinGroup("refit-1", "refit-1/stage1", 1, 0, 2, "gloo", "", group.members, 45.0),
        ExecutePlan("refit-1", 4, (bucket,), (group,), 30.5),
        ExecutePlan(
            "refit-1", 4, (bucket,), (group,), 30.5, ipc_links=frozenset({(1, "trainer-1", "generator-0-0")})
        ),
        Verify("refit-1", 4, 60.0),
        Commit("refit-1", 4, 12.25),
        Abort("refit-1", "checksum mismatch"),
    ):
        wire = convert.command_to_pb(cmd).SerializeToString()
        assert convert.command_from_pb(pb.Command.FromString(wire)) == cmd


def test_checksum_key_spells_a_canonical_region() -> None:
    box = Box((0, 2, 5), (4, 6, 9))
    assert checksum_key("w", box) == "w[0:4,2:6,5:9]"
