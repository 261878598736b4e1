"""Where pip finds packages, as uv's environment: `make setup` installs with uv, which does not
read pip's configuration.

    eval "$(python -m deploy.local.uv_env)"   # export UV_FIND_LINKS=... UV_EXTRA_INDEX_URL=... ...

A machine's package sources are pip's settings (pip.conf files, `PIP_*` variables): a local wheel
folder, a mirror, a constraints file. `pip config list` shows each setting of every scope, the
environment's first, which is pip's own order of precedence; the first value of a key wins. Only
the settings that say where packages come from and which versions are allowed are handed over.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

# pip's key -> (uv's variable, how uv separates several values)
SETTINGS = {
    "index-url": ("UV_INDEX_URL", " "),
    "extra-index-url": ("UV_EXTRA_INDEX_URL", " "),
    "find-links": ("UV_FIND_LINKS", ","),
    "constraint": ("UV_CONSTRAINT", " "),
}
_LINE = re.compile(r"^[^.]*\.(?P<key>[a-z-]+)='(?P<value>.*)'$")


def pip_settings(listing: str) -> dict[str, str]:
    """The first value of each key in `pip config list`'s output."""
    found: dict[str, str] = {}
    for line in listing.splitlines():
        match = _LINE.match(line.strip())
        if match:
            found.setdefault(match["key"], match["value"])
    return found


def uv_environment(settings: dict[str, str]) -> dict[str, str]:
    return {
        variable: separator.join(settings[key].split())
        for key, (variable, separator) in SETTINGS.items()
        if settings.get(key, "").strip()
    }


def main() -> None:
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    for variable, value in uv_environment(pip_settings(listing)).items():
        print(f"export {variable}={shlex.quote(value)}")


if __name__ == "__main__":
    main()
