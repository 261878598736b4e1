"""`python -m generator_svc.attach`: print the `vllm serve` flags weight sync needs."""

import sys

from generator_svc.attach.engine_args import SERVE_FLAGS


def main() -> int:
    print(" ".join(SERVE_FLAGS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
