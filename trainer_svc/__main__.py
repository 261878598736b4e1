"""`torchrun --nproc-per-node N -m trainer_svc --pp P --ep E --tp T --model-dir DIR ...`"""

from __future__ import annotations

import logging
import sys

from trainer_svc.job import run
from trainer_svc.settings import LaunchEnv, TrainSettings


def main(argv: list[str] | None = None) -> int:
    env = LaunchEnv.from_env()
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s trainer rank={env.rank} %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = TrainSettings.from_argv(argv)
    except ValueError as e:
        print(f"trainer_svc: {e}", file=sys.stderr)
        return 2
    run(settings, env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
