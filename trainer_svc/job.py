"""One trainer rank's whole job: join the process groups, build the stage, register with syncd
(when asked), train, export, leave. Kept apart from `train.py` so that the syncd agent, which
drives a `Trainer`, and the trainer do not import each other."""

from __future__ import annotations

from trainer_svc.settings import LaunchEnv, TrainSettings
from trainer_svc.train import Trainer, TrainResult, process_group


def run(
    settings: TrainSettings, env: LaunchEnv, init_method: str | None = None
) -> tuple[Trainer, TrainResult]:
    """One rank's whole job: join, build, register with syncd (if asked), train, export, leave."""
    with process_group(settings, env, init_method) as device:
        trainer = Trainer.create(settings, env, device)
        agent = None
        if settings.syncd:
            from trainer_svc.agent import RankAgent  # needs grpc; standalone training does not

            agent = RankAgent.start(
                settings.syncd,
                trainer,
                env,
                settings.data_host,
                sync_refit_s=settings.refit_timeout if settings.sync_refit else None,
                in_flight=settings.in_flight_buckets,
                auth_token=settings.auth_token,
            )
        try:
            result = trainer.fit()
            if settings.export_dir:
                trainer.export(settings.export_dir)
        finally:
            if agent is not None:
                agent.close()
    return trainer, result
