"""Where the demo's and the end-to-end tests' services run: all on this machine's loopback (no
lab), or each role on its own host of a lab. The callers name hosts by role, `HOSTS`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from deploy.lab.lab import Lab

SYNCD, TRAINER = "syncd", "trainer"
LOOPBACK = "127.0.0.1"


def generator_host(replica: int) -> str:
    return f"gen{replica}"


def hosts(replicas: int) -> list[str]:
    """The lab hosts of a deployment with `replicas` generator replicas."""
    return [SYNCD, TRAINER, *(generator_host(r) for r in range(replicas))]


@dataclass(frozen=True)
class Placement:
    lab: Lab | None = None

    def address(self, host: str) -> str:
        """Where the service on `host` listens (and what it reports for its data plane); this
        machine reaches it there too (the lab's gateway)."""
        return LOOPBACK if self.lab is None else self.lab.address(host)

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """`argv` to start the service of `host`."""
        return list(argv) if self.lab is None else self.lab.command(host, argv)
