"""A refit's live progress over HTTP: the models `GET /v1/refits/{id}` adds to the refit
(`RefitProgressOut`), and the server-sent events of `GET /v1/refits/{id}/events`
(`progress_events`), so a dashboard or a framework's driver follows a refit without polling.

The stream sends one `progress` event (the same JSON as `GET /v1/refits/{id}`) when the refit's
state or bytes change, at most every `EVENT_INTERVAL_S`, and at least every `KEEPALIVE_S` (the
ETA and rates move even when no bytes arrived); after the final state, one `end` event, and it
closes. A client that reconnects gets the current state at once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from syncd.daemon.http_models import RefitOut
from syncd.daemon.progress import LinkShare, RefitProgress, Share
from syncd.daemon.store import RefitRecord
from syncd.states import TERMINAL

EVENT_INTERVAL_S = 0.25
KEEPALIVE_S = 1.0


class ShareOut(BaseModel):
    bytes_done: int
    bytes_total: int
    fraction: float = Field(description="bytes_done / bytes_total (1 when there is nothing to move)")
    rate_bytes_per_s: float = Field(description="over the last seconds (syncd.daemon.progress)")

    @classmethod
    def of(cls, s: Share) -> ShareOut:
        return cls(bytes_done=s.done, bytes_total=s.total, fraction=s.fraction, rate_bytes_per_s=s.rate)


class StageShareOut(ShareOut):
    stage: int


class MemberShareOut(ShareOut):
    member_id: str = Field(description="a receiving member: its incoming links together")


class LinkShareOut(ShareOut):
    stage: int
    src: str
    dst: str
    relay: bool = Field(description="src is a replica forwarding what it received (fan-out)")
    eta_s: float | None = Field(description="seconds left on this link at its rate; null before it moved")

    @classmethod
    def of_link(cls, s: LinkShare) -> LinkShareOut:
        share = ShareOut.of(s.share).model_dump()
        return cls(**share, stage=s.stage, src=s.src, dst=s.dst, relay=s.relay, eta_s=s.eta_s)


class ProgressOut(ShareOut):
    state: str
    eta_s: float | None = Field(description="seconds until the refit ends (verify and commit included)")
    eta_source: str = Field(description="live (the links' rates), model (past refits) or none")
    elapsed_s: float = Field(description="seconds since TRANSFERRING started")
    since_progress_s: float = Field(description="seconds since bytes last arrived")
    slowest: LinkShareOut | None = Field(description="the link that ends last: its dst is the slowest member")
    stages: list[StageShareOut]
    members: list[MemberShareOut]
    links: list[LinkShareOut]
    updated_at: float

    @classmethod
    def of_progress(cls, p: RefitProgress) -> ProgressOut:
        return cls(
            **ShareOut.of(p.total).model_dump(),
            state=p.state,
            eta_s=p.eta_s,
            eta_source=p.eta_source,
            elapsed_s=p.elapsed_s,
            since_progress_s=p.since_progress_s,
            slowest=None if p.slowest is None else LinkShareOut.of_link(p.slowest),
            stages=[StageShareOut(**ShareOut.of(s).model_dump(), stage=k) for k, s in p.stages.items()],
            members=[
                MemberShareOut(**ShareOut.of(s).model_dump(), member_id=m) for m, s in p.members.items()
            ],
            links=[LinkShareOut.of_link(s) for s in p.links],
            updated_at=p.updated_at,
        )


class RefitProgressOut(RefitOut):
    progress: ProgressOut | None = Field(
        description="bytes, rates and ETA while it runs, as it ended after; null when syncd no longer "
        "holds it (it ended long ago or before syncd started)"
    )

    @classmethod
    def with_progress(cls, r: RefitRecord, p: RefitProgress | None) -> RefitProgressOut:
        return cls(**RefitOut.of(r).model_dump(), progress=None if p is None else ProgressOut.of_progress(p))


async def progress_events(
    read: Callable[[], RefitProgressOut], interval_s: float = EVENT_INTERVAL_S
) -> AsyncIterator[str]:
    """The event stream of one refit; `read` gives it as it is now (called off the event loop)."""
    last_key: tuple | None = None
    waited = 0.0
    while True:
        body = await run_in_threadpool(read)
        key = (body.state, body.progress.bytes_done if body.progress else None)
        if key != last_key or waited >= KEEPALIVE_S:
            yield _event("progress", body.model_dump_json())
            last_key, waited = key, 0.0
        if body.state in TERMINAL:
            yield _event("end", json.dumps({"id": body.id, "state": body.state}))
            return
        await asyncio.sleep(interval_s)
        waited += interval_s


def _event(name: str, data: str) -> str:
    return f"event: {name}\ndata: {data}\n\n"
