"""`python -m generator_svc --model DIR [--syncd ADDR] [--port P] [--tensor-parallel-size N] ...`"""

from __future__ import annotations

import contextlib
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    import uvloop

    from generator_svc.server.app import serve
    from generator_svc.settings import parse

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s generator %(name)s: %(message)s"
    )
    # vLLM's app setup may lower the root logger's level (an import it makes reconfigures logging);
    # ours stays at INFO so the generator's own lines (guard, engine death) are never lost.
    logging.getLogger("generator_svc").setLevel(logging.INFO)
    settings, args = parse(argv)
    with contextlib.suppress(KeyboardInterrupt):
        return uvloop.run(serve(settings, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
