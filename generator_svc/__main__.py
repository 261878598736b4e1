"""`python -m generator_svc --model DIR [--syncd ADDR] [--port P] [--tensor-parallel-size N] ...`"""

from __future__ import annotations

import contextlib
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    import uvloop

    from generator_svc.app import serve
    from generator_svc.settings import parse

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s generator %(name)s: %(message)s"
    )
    settings, args = parse(argv)
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(serve(settings, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
