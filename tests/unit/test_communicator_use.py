"""A communicator takes calls from one thread at a time (NCCL's are not thread-safe), and a send
loop that posts to several peers at once does so in rounds that keep each link's order."""

from __future__ import annotations

import threading

import pytest

from syncd.member.dataplane import ConcurrentUse
from syncd.member.dataplane.executor import send_rounds
from syncd.member.dataplane.transport import OneCaller
from syncd.plan.types import Bucket


def test_a_second_thread_inside_a_communicator_raises_naming_both_threads():
    guard = OneCaller("NCCL communicator of rank 0/3")
    inside, leave = threading.Event(), threading.Event()

    def first():
        with guard():
            inside.set()
            leave.wait(10)

    holder = threading.Thread(target=first, name="stage0-sender")
    holder.start()
    try:
        assert inside.wait(10)
        with pytest.raises(ConcurrentUse, match="stage0-sender") as raised, guard():
            pass
        assert threading.current_thread().name in str(raised.value)
    finally:
        leave.set()
        holder.join()


def test_one_thread_after_another_is_fine_and_a_failure_inside_frees_the_communicator():
    guard = OneCaller("gloo group")
    with pytest.raises(ValueError), guard():
        raise ValueError("the send failed")
    done = []

    def another():
        with guard():
            done.append(threading.current_thread().name)

    t = threading.Thread(target=another, name="stage1-sender")
    t.start()
    t.join()
    assert done == ["stage1-sender"]


def _bucket(dst: str, index: int) -> Bucket:
    return Bucket(src="trainer-0", dst=dst, index=index, stage=0, units=(), nbytes=1)


def test_grouped_rounds_send_every_links_rth_bucket_together_and_keep_each_links_order():
    buckets = [_bucket(d, i) for d, n in (("gen-1", 2), ("gen-0", 3)) for i in range(n)]
    rounds = send_rounds(buckets, grouped=True)
    assert [[(b.dst, b.index) for b in r] for r in rounds] == [
        [("gen-0", 0), ("gen-1", 0)],
        [("gen-0", 1), ("gen-1", 1)],
        [("gen-0", 2)],
    ]
    ungrouped = send_rounds(buckets, grouped=False)
    assert [[(b.dst, b.index) for b in r] for r in ungrouped] == [
        [("gen-0", 0)],
        [("gen-0", 1)],
        [("gen-0", 2)],
        [("gen-1", 0)],
        [("gen-1", 1)],
    ]
