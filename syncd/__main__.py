"""`python -m syncd` / `syncd`: run the weight-sync daemon until SIGINT or SIGTERM."""

from __future__ import annotations

import logging
import signal
import sqlite3
import sys
from collections.abc import Sequence

from syncd.daemon.service import Daemon
from syncd.daemon.settings import Settings


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = Settings.load(argv)
    except ValueError as e:
        print(f"syncd: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s syncd %(name)s: %(message)s"
    )
    try:
        daemon = Daemon(settings)
    except (OSError, sqlite3.Error, ValueError) as e:  # port taken, unwritable db, bad stored value
        logging.getLogger("syncd").error("cannot start: %s", e)
        return 1
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: daemon.request_stop())
    try:
        daemon.start()
        daemon.wait()
    except OSError as e:
        logging.getLogger("syncd").error("cannot serve: %s", e)
        return 1
    finally:
        daemon.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
