"""The member library's fixed vocabularies arrive as enums, and each has its way through: a
command naming a backend or link transport the member does not know is refused where it is
decoded, naming the field; every backend syncd may choose has a way to join its group, and every
part a member may play in a stage has a loop."""

from __future__ import annotations

import pytest

from syncd.api import convert
from syncd.commands import JoinGroup
from syncd.member.agent.join import _CONNECT
from syncd.member.agent.stage_loops import _LOOPS, LoopKind
from syncd.vocabulary import Backend, LinkTransport


def _join_group() -> JoinGroup:
    members = ("trainer-0", "generator-0-0")
    links = (LinkTransport.SHM, LinkTransport.GLOO)
    return JoinGroup(
        "refit-1", "refit-1/stage0", 0, 1, 2, Backend.GLOO, "127.0.0.1:1234", members, 30.0, links
    )


def test_a_join_group_decodes_to_its_enums():
    decoded = convert.command_from_pb(convert.command_to_pb(_join_group()))
    assert isinstance(decoded, JoinGroup)
    assert decoded.backend is Backend.GLOO
    assert decoded.links == (LinkTransport.SHM, LinkTransport.GLOO)
    assert all(isinstance(link, LinkTransport) for link in decoded.links)


def test_an_unknown_backend_or_link_is_refused_by_name():
    msg = convert.command_to_pb(_join_group())
    msg.join_group.backend = "ucx"
    with pytest.raises(
        ValueError, match=r"JoinGroup.backend 'ucx' is not a Backend; expected one of 'gloo', 'nccl'"
    ):
        convert.command_from_pb(msg)
    msg = convert.command_to_pb(_join_group())
    msg.join_group.links[1] = "rdma"
    with pytest.raises(ValueError, match=r"JoinGroup.links 'rdma' is not a LinkTransport"):
        convert.command_from_pb(msg)


def test_every_backend_has_a_way_in_and_every_part_a_loop():
    assert set(_CONNECT) == set(Backend)
    assert set(_LOOPS) == set(LoopKind)
