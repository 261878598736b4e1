"""Start a child as a command in a terminal starts: with SIGINT and SIGTERM at their defaults.

A suite run as a background job (`make test &`) has SIGINT ignored, and an ignored signal stays
ignored through exec, while a handled one is reset to its default. So the parent handles both
while it starts the child. Not `preexec_fn`: that makes subprocess fork the whole pytest process,
and where gRPC threads run (an in-process syncd), gRPC's fork handlers have aborted the child
before its exec (`epoll_wait error: Bad file descriptor`, SIGABRT).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


@contextlib.contextmanager
def signals_as_in_a_terminal() -> Iterator[None]:
    """Children started inside start with SIGINT and SIGTERM at their defaults (main thread)."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if previous[signal.SIGTERM] == signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # None: set outside Python, left as it is now
                signal.signal(sig, handler)
