"""The rank agent: registers this trainer rank with syncd and serves its shards to refits.

Lifecycle: `RankAgent.start` builds the rank's catalog, joins syncd through the member library's
front door (`syncd.member.join`: role trainer, member id `trainer-{rank}`, mesh coords, this
rank's `TrainerEndpoint`), and hooks into the trainer so every optimizer step is announced as a
new weight version; `close` leaves syncd and tears down the data-plane groups.

The data plane reads the parameters in place (`LocalShards`, no copy) through `TrainerEndpoint`,
which holds the trainer's lock from the start to the end of this rank's transfer, so no optimizer
step changes them mid-transfer (with delta refits on, until syncd's Verify, once the rank's mirror
took what it sent: `syncd.member.agent`). A rank whose weights are no longer the requested version refuses:
the refit aborts rather than give generators a model torn between two versions. With
`sync_refit`, a rank waits after announcing each step until a refit of it commits or aborts.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence

import torch

from syncd.layout import Catalog
from syncd.member import Membership, join
from syncd.member.client import MemberClient
from syncd.member.dataplane import catalog_views
from syncd.member.refit_outcomes import RefitOutcomes
from syncd.plan.types import Bucket
from syncd.vocabulary import Role
from syncd.weight_version import WeightVersion
from trainer_svc.catalog import build_catalog
from trainer_svc.settings import LaunchEnv
from trainer_svc.train import StepStats, Trainer

log = logging.getLogger("trainer_svc.agent")


class LocalShards:
    """This rank's local tensors by catalog name, each a view of the live parameter in the
    catalog's shape (e.g. the fused gate/up weight as [E_l, 2, I_l, H]); nothing is copied.
    Read them inside `reading()`, which holds the trainer's lock: the optimizer cannot step then."""

    def __init__(self, catalog: Catalog, params: Mapping[str, torch.Tensor], lock: threading.Lock) -> None:
        self.catalog = catalog
        self._views = catalog_views(catalog, {n: p.detach() for n, p in params.items()})
        self._lock = lock

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._views[name]

    def __len__(self) -> int:
        return len(self._views)

    def names(self) -> list[str]:
        return list(self._views)

    @property
    def views(self) -> Mapping[str, torch.Tensor]:
        """The views without the lock: for the data plane, which holds the lock itself."""
        return self._views

    @contextlib.contextmanager
    def reading(self) -> Iterator[Mapping[str, torch.Tensor]]:
        with self._lock:
            yield self._views


class TrainerEndpoint:
    """This rank as the data plane sees it: live parameter views, held still while they are sent."""

    def __init__(self, shards: LocalShards, trainer: Trainer, member_id: str) -> None:
        self.shards, self.trainer, self.member_id = shards, trainer, member_id
        self._held = False
        self.outcomes = RefitOutcomes()

    def begin(
        self, refit_id: str, weight_version: WeightVersion, buckets: Sequence[Bucket]
    ) -> Mapping[str, torch.Tensor]:
        self.outcomes.began(weight_version)
        self.trainer.lock.acquire()
        self._held = True
        if self.trainer.version != weight_version:
            self.end(refit_id, ok=False)
            raise ValueError(
                f"{self.member_id}: refit {refit_id} moves weight version {weight_version}, "
                f"but this rank holds version {self.trainer.version}"
            )
        return self.shards.views

    def end(self, refit_id: str, ok: bool) -> None:
        if self._held:
            self._held = False
            self.trainer.lock.release()

    def verify(self, refit_id: str) -> None:
        pass  # a trainer keeps no staged copy: what it sent is what it holds

    def commit(self, refit_id: str, weight_version: WeightVersion, timeout_s: float) -> None:
        self.outcomes.committed(weight_version)

    def abort(self) -> None:
        self.outcomes.aborted()

    def wait_refit(self, version: WeightVersion, timeout_s: float) -> str:
        """See `RefitOutcomes.wait`: "committed", "aborted" or "timeout"."""
        return self.outcomes.wait(version, timeout_s)


class RankAgent:
    def __init__(self, member: Membership, endpoint: TrainerEndpoint, sync_refit_s: float | None) -> None:
        self.member, self.endpoint = member, endpoint
        self.sync_refit_s = sync_refit_s

    @property
    def client(self) -> MemberClient:
        return self.member.client

    @staticmethod
    def start(
        target: str,
        trainer: Trainer,
        env: LaunchEnv,
        data_host: str = "127.0.0.1",
        sync_refit_s: float | None = None,
        in_flight: int = 2,
        auth_token: str | None = None,
    ) -> RankAgent:
        mesh = trainer.mesh
        # The weights the model computes with (bfloat16 copies of the float32 masters, when it
        # trains in bfloat16): what a generator serves.
        catalog = build_catalog(trainer.args, mesh.dims, mesh.coords, trainer.precision.dtype)
        shards = LocalShards(catalog, trainer.precision.weights, trainer.lock)
        member_id = f"trainer-{env.rank}"
        run_id = [uuid.uuid4().hex]  # this training run, as syncd knows it: rank 0's id on every rank
        if torch.distributed.is_initialized():
            torch.distributed.broadcast_object_list(run_id, src=0)
        endpoint = TrainerEndpoint(shards, trainer, member_id)
        member = join(
            target,
            endpoint,
            role=Role.TRAINER,
            member_id=member_id,
            coords=mesh.coords.as_dict(),
            catalog=catalog,
            device=str(trainer.device),
            data_host=data_host,
            auth_token=auth_token,
            run_id=run_id[0],
            in_flight=in_flight,
        )
        rank_agent = RankAgent(member, endpoint, sync_refit_s)
        trainer.after_step.append(rank_agent.on_step)
        return rank_agent

    def on_step(self, stats: StepStats) -> None:
        version = WeightVersion(stats.step)  # a trainer's weights are versioned by its optimizer steps
        try:
            self.client.announce_version(version)
        except Exception as e:  # noqa: BLE001 - syncd down (in whatever way) must not stop training
            # Not lost: the client holds the version and re-registers with it once syncd is back,
            # which announces it (`syncd.daemon.versions`). So a synchronous trainer still waits for its
            # refit; returning here let a job's last step finish, unannounced, while syncd
            # restarted, and the job exit before anyone could move its weights.
            log.warning(
                "could not announce version %d to syncd now (%s); it is announced when this rank "
                "re-registers",
                version,
                e,
            )
        if self.sync_refit_s is not None:
            outcome = self.endpoint.wait_refit(version, self.sync_refit_s)
            if outcome != "committed":
                log.warning("refit of version %d: %s; training goes on", version, outcome)

    def close(self) -> None:
        self.member.close()
