"""The rank agent: registers this trainer rank with syncd and serves its shards to refits.

Lifecycle: `RankAgent.start` builds the rank's catalog, joins syncd through the member library's
front door (`syncd.member.join`: role trainer, member id `trainer-{rank}`, mesh coords, this
rank's `SenderEndpoint`), and hooks into the trainer so every optimizer step is announced as a
new weight version; `close` leaves syncd and tears down the data-plane groups.

The data plane reads the parameters in place (`LocalShards`, no copy) through the member library's
`SenderEndpoint` (`syncd.member.sender`), which holds the trainer's lock from the start to the end
of this rank's transfer, so no optimizer step changes them mid-transfer, and refuses a refit of
another version than the rank holds. With `sync_refit`, a rank waits after announcing each step
until every generator serves it, or its refit failed (`syncd.member.refit_outcomes`; training goes
on either way, and the log names the refit, its state, the member and the reason).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Iterator, Mapping

import torch

from syncd.layout import Catalog
from syncd.member import Membership, join
from syncd.member.client import MemberClient
from syncd.member.dataplane import catalog_views
from syncd.member.refit_outcomes import RefitFailed, wait_served
from syncd.member.sender import SenderEndpoint
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


class RankAgent:
    def __init__(self, member: Membership, endpoint: SenderEndpoint, sync_refit_s: float | None) -> None:
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
        weights = trainer.precision.weights
        if trainer.lora is not None:
            # A LoRA run refits only its target modules, merged in the served dtype (partial).
            served = str(trainer.lora.dtype).removeprefix("torch.")
            catalog = trainer.lora.refit_catalog(build_catalog(trainer.args, mesh.dims, mesh.coords, served))
            weights = trainer.lora.merged
        shards = LocalShards(catalog, weights, trainer.lock)
        member_id = f"trainer-{env.rank}"
        run_id = [uuid.uuid4().hex]  # this training run, as syncd knows it: rank 0's id on every rank
        if torch.distributed.is_initialized():
            torch.distributed.broadcast_object_list(run_id, src=0)
        # the trainer's lock and version, and the shards' views (`syncd.member.sender`)
        endpoint = SenderEndpoint(member_id, trainer, lambda: shards.views)
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
            try:
                log.info(
                    "%s; every generator serves it", wait_served(self.client, version, self.sync_refit_s)
                )
            except RefitFailed as e:
                log.warning("%s; training goes on", e)

    def close(self) -> None:
        self.member.close()
