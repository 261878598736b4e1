"""`make setup` hands pip's package sources to uv (deploy/local/uv_env.py)."""

from __future__ import annotations

import subprocess
import sys

from deploy.local.uv_env import pip_settings, uv_environment

LISTING = """\
:env:.default-timeout='180'
:env:.find-links='/opt/wheels /srv/more-wheels'
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/ignored/the/environment/wins'
user.index-url='https://mirror.example/simple'
"""


def test_the_environment_wins_and_only_package_sources_pass() -> None:
    assert uv_environment(pip_settings(LISTING)) == {
        "UV_INDEX_URL": "https://mirror.example/simple",
        "UV_EXTRA_INDEX_URL": "file:///opt/pypi/simple file:///opt/pypi-more/simple",
        "UV_FIND_LINKS": "/opt/wheels,/srv/more-wheels",  # uv separates these by commas
        "UV_CONSTRAINT": "/etc/xdg/pip/constraints.txt",
    }


def test_nothing_configured_sets_nothing() -> None:
    assert uv_environment(pip_settings("")) == {}


def test_the_module_prints_shell_exports_of_this_machines_pip() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "deploy.local.uv_env"], capture_output=True, text=True, check=True
    ).stdout
    assert all(line.startswith("export UV_") for line in out.splitlines()), out
