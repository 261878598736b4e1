"""Delta refits on the data plane: a link moves only the elements that changed since the version
its receiver holds (syncd names that version, the base, and the links that go as deltas).

The sender (a trainer rank) keeps a `Mirror`: the bytes it last sent, per local tensor and
destination dtype, after the conversion (a delta is taken in the generator's dtype, bit for bit).
Per delta link, in the plan's order:

1. Group by group of buckets (3.), the sender compares every unit's new values with its mirror
   (once per tensor per refit: links that move the same region share the result, `compare.Diffs`) and
   sends the group's header: per unit, how many elements changed and whether the unit goes dense.
   A tensor whose sample of 1024 elements is mostly changed goes dense without the exact
   comparison (a step that changes everything is seen in a fraction of it).
2. A unit whose (index, value) pairs would cost as much as its dense bytes goes dense. A bucket
   whose encoding would not save `max_fraction` of its bytes goes dense whole, through the
   executor's own pipelined loop (`send_buckets` / `recv_buckets`), exactly as a full refit
   sends it. The mirror takes what was sent after the transfer (`compare.Diffs.commit`: the changed
   positions of delta units, the whole regions of dense ones, from the sender's tensors), off the
   refit's path: a member's agent commits after it reported the transfer, still holding the
   trainer's weights, so the trainer's next optimizer step waits for the copy
   (`syncd.member.agent`). A step that changes nearly everything so costs a full refit on the
   refit's path, plus one copy of the weights into the mirror beside it.
3. The link goes in groups of buckets (`wire._groups`): each group's header, then the encodings of its
   other buckets, one piece: per unit, int32 positions (C order
   of the unit's region, ascending) and their values, or the unit's dense bytes; each part 8-byte
   aligned. The receiver sizes the piece from the header, forwards it on (a relay) as it arrived
   and applies it, so comparing, the wire, every hop of a chain and applying overlap group by
   group (one message for the link would cross each hop whole before the next hop began). Gloo
   sends a message only once its receive is posted, so a receiver takes the groups on a thread of
   its own (`receive._Taker`) while it applies the ones before, with the next header posted behind each
   piece. A link that goes dense whole sends its first header only (`send._dense_whole`).

Verification covers whole regions, not the delta: the sender checksums each unit's full new values
and the receiver its full destination region after applying the delta, under the same keys as a
full refit (`checksum_key`), so syncd's comparison is the same and a receiver whose base is not the
sender's mirror (a restart, a torn refit, a flipped bit) fails it and the refit aborts.

Modules: `wire` (what both ends agree on: message parts, header codes, groups, trailers),
`compare` (the sender's mirror and its comparisons), `send`, `receive`, and `scatter` (writing
values at positions within a box, for the receiver and the mirror alike).
"""

from syncd.member.dataplane.delta.compare import Change, Diffs, Mirror
from syncd.member.dataplane.delta.receive import DeltaSink, LinkForward, Undo, recv_with_deltas
from syncd.member.dataplane.delta.scatter import scatter_flat, unravel_flat
from syncd.member.dataplane.delta.send import send_with_deltas
from syncd.member.dataplane.delta.wire import DeltaStats

__all__ = [
    "Change",
    "DeltaSink",
    "DeltaStats",
    "Diffs",
    "LinkForward",
    "Mirror",
    "Undo",
    "recv_with_deltas",
    "scatter_flat",
    "send_with_deltas",
    "unravel_flat",
]
