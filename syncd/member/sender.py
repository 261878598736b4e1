"""A trainer rank as the data plane sees it: the one sender endpoint, shared by our trainer
(`trainer_svc.agent`) and by any PyTorch trainer (`syncd.member.attach`).

The data plane reads the live parameters in place (no copy). `begin` takes the trainer's lock,
which every optimizer step takes too, and keeps it until `end`, so no step changes a parameter
while it is being sent (with delta refits on, until syncd's Verify, once the agent's mirror took
what was sent: `syncd.member.agent`). A rank whose parameters hold another version than the
refit moves refuses: the refit aborts rather than hand generators a model torn between two
versions. A trainer that waits for its refits asks syncd (`syncd.member.refit_outcomes`): this
rank's Commit comes before the generators installed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch

from syncd.plan.types import Bucket
from syncd.weight_version import WeightVersion


class HeldWeights(Protocol):
    """The trainer's side of its weights: `lock` is held by every optimizer step (and by a
    transfer, from `begin` to `end`); `version` is what the parameters hold, changed under it."""

    lock: threading.Lock
    version: WeightVersion


class SenderEndpoint:
    """`read_views` gives the parameters' local shards as views in the catalog's shapes; it is
    called at each `begin`, under the lock (FSDP2 and optimizers may swap storage between refits)."""

    def __init__(
        self,
        member_id: str,
        weights: HeldWeights,
        read_views: Callable[[], Mapping[str, torch.Tensor]],
    ) -> None:
        self.member_id, self.weights, self._read_views = member_id, weights, read_views
        self._held = False

    def begin(
        self, refit_id: str, weight_version: WeightVersion, buckets: Sequence[Bucket]
    ) -> Mapping[str, torch.Tensor]:
        self.weights.lock.acquire()
        self._held = True
        if self.weights.version != weight_version:
            self.end(refit_id, ok=False)
            raise ValueError(
                f"{self.member_id}: refit {refit_id} moves weight version {weight_version}, "
                f"but this rank holds version {self.weights.version}"
            )
        return self._read_views()

    def end(self, refit_id: str, ok: bool) -> None:
        if self._held:
            self._held = False
            self.weights.lock.release()

    def verify(self, refit_id: str) -> None:
        pass  # a sender keeps no staged copy: what it sent is what it holds

    def commit(self, refit_id: str, weight_version: WeightVersion, timeout_s: float) -> None:
        pass  # what it sent is what the generators install; it holds nothing to make live

    def abort(self) -> None:
        pass  # `end` released the weights already
