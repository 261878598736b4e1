"""Digests of weight versions: what each generator must hold, by the senders' word.

At every commit syncd records, per receiving member (generator worker), the senders' checksums of
every canonical region the member received (`syncd.commands.checksum_key` -> checksum, the
algorithm of `syncd.member.dataplane.checksum`). The checksums are of the bytes in the
destination's format (after dtype conversion or FP8 quantizing: what the sender packed), so a
generator's digest of what it holds compares one to one. A generator reports its digest
(`GET /v1/weights/digest`) and `compare` names every region that differs; `syncctl verify` does
both.

The newest committed version's digest is kept in the store (it survives a restart), written off
the refit's path; older ones in memory only, the last `KEPT` of them.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from syncd.commands import checksum_key
from syncd.daemon.errors import NotFound
from syncd.daemon.store import Store, StoreUnavailable
from syncd.plan import Plan
from syncd.weight_version import WeightVersion, parse_weight_version

log = logging.getLogger(__name__)

KEPT = 16
_STORE_KEY = "committed_digest"


@dataclass(frozen=True)
class VersionDigest:
    run_id: str
    weight_version: WeightVersion
    members: Mapping[str, Mapping[str, str]]  # receiving member -> region key -> sender's checksum


@dataclass(frozen=True)
class Difference:
    member_id: str
    region: str  # the checksum key: canonical tensor and box, e.g. `w[0:8,0:16]`
    expected: str  # the senders' checksum ("" when syncd has none for the region)
    got: str  # the member's ("" when it reported none)

    @property
    def tensor(self) -> str:
        return self.region.partition("[")[0]


def digest_of(plan: Plan, checksums: Mapping[str, Mapping[str, str]]) -> dict[str, dict[str, str]]:
    """Per receiving member, the checksums its regions' senders (the trainer rank that packed the
    bytes, also behind a relay) reported, `checksums[member][key]`, checked equal before."""
    out: dict[str, dict[str, str]] = {}
    for b in plan.buckets:
        sent = checksums.get(b.origin, {})
        mine = out.setdefault(b.dst, {})
        for u in b.units:
            key = checksum_key(u.canonical, u.canon)
            mine[key] = sent.get(key, "")
    return out


def compare(digest: VersionDigest, member_id: str, reported: Mapping[str, str]) -> list[Difference]:
    """Every region of `member_id` in `digest` whose reported checksum is missing or differs,
    and every reported region the digest does not have."""
    expected = digest.members.get(member_id)
    if expected is None:
        raise NotFound(
            f"version {digest.weight_version} of run {digest.run_id!r} was not committed to "
            f"{member_id}; its members: {', '.join(sorted(digest.members)) or 'none'}"
        )
    out = [
        Difference(member_id, key, want, reported.get(key, ""))
        for key, want in expected.items()
        if reported.get(key) != want
    ]
    out += [Difference(member_id, key, "", got) for key, got in reported.items() if key not in expected]
    return sorted(out, key=lambda d: d.region)


class Digests:
    """The recorded digests. Thread-safe: the refit thread records, HTTP handlers read."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._store_lock = threading.Lock()
        self._by_version: OrderedDict[tuple[str, WeightVersion], VersionDigest] = OrderedDict()
        self.latest: VersionDigest | None = None
        saved = store.get_text(_STORE_KEY)
        if saved:
            d = json.loads(saved)
            self._keep(VersionDigest(d["run_id"], parse_weight_version(d["weight_version"]), d["members"]))

    def committed(self, digest: VersionDigest) -> None:
        """Record the digest of a version just committed (after the decision was written). Stored
        on a thread of its own: a locked store must not delay the Commit behind it."""
        with self._lock:
            self._keep(digest)
        threading.Thread(target=self._store_latest, args=(digest,), name="digest-store", daemon=True).start()

    def _store_latest(self, digest: VersionDigest) -> None:
        text = json.dumps(
            {"run_id": digest.run_id, "weight_version": digest.weight_version, "members": digest.members}
        )
        with self._store_lock:  # one writer at a time, and only the newest digest is written
            if self.latest is not digest:
                return
            try:
                self._store.set_meta({_STORE_KEY: text})
            except StoreUnavailable as e:  # the refit is committed either way; only a restart forgets
                log.warning("could not store the digest of version %s: %s", digest.weight_version, e)

    def _keep(self, digest: VersionDigest) -> None:
        key = (digest.run_id, digest.weight_version)
        self._by_version.pop(key, None)
        self._by_version[key] = digest
        while len(self._by_version) > KEPT:
            self._by_version.popitem(last=False)
        self.latest = digest

    def get(self, weight_version: WeightVersion | None = None) -> VersionDigest:
        """The newest committed version's digest, or that of `weight_version` (the newest run's
        that has one). Raises NotFound naming what is kept."""
        with self._lock:
            if weight_version is None and self.latest is not None:
                return self.latest
            for (_, version), digest in reversed(self._by_version.items()):
                if version == weight_version:
                    return digest
            kept = ", ".join(str(v) for _, v in self._by_version) or "none"
        what = (
            "no version committed yet" if weight_version is None else f"no digest of version {weight_version}"
        )
        raise NotFound(f"{what}; digests kept of versions: {kept}")
