"""The syncd settings every test starts from: loopback, free ports, a database in the test's own
folder, short leases and phase timeouts, gloo.

Tests name only what they change (`syncd_settings(tmp_path, bucket_bytes=32 << 10)`), so a
reader sees at once what a test's syncd does differently from the rest.
"""

from __future__ import annotations

from pathlib import Path

from syncd.daemon.settings import Settings
from syncd.net import free_port

# Short enough that a lost member or a stuck phase fails a test in seconds, long enough for a
# loaded 2-core machine to get through each phase of a tiny model's refit.
TEST_DEFAULTS: dict[str, object] = {
    "host": "127.0.0.1",
    "lease_seconds": 3.0,
    "prepare_timeout": 30.0,
    "transfer_timeout": 30.0,
    "verify_timeout": 30.0,
    "commit_timeout": 30.0,
    "backend": "gloo",
}


def syncd_settings(tmp_path: Path, **overrides: object) -> Settings:
    """`Settings` for a syncd of one test: `TEST_DEFAULTS`, fresh ports, `tmp_path/syncd.db`, then
    `overrides` (any field of `Settings`)."""
    fields: dict[str, object] = {
        **TEST_DEFAULTS,
        "http_port": free_port(),
        "grpc_port": free_port(),
        "db": str(tmp_path / "syncd.db"),
        **overrides,
    }
    return Settings(**fields)  # type: ignore[arg-type]  # each value has its field's type
