"""The README's code, run as a user would copy it: the Python block under a heading, with only the
placeholders a reader fills in (syncd's address, the model's path) filled in.

The tests pass a snippet what it takes from the surrounding program (`model`, `optimizer`,
`data`; `steps`, `prompts`, `sampling_params`) as its globals. A README edit that breaks a snippet,
or changes a placeholder, fails its test here rather than a user's first run.
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
SYNCD_PLACEHOLDER = "syncd-host:8471"
MODEL_PLACEHOLDER = "path/to/qwen3-moe"


def python_block(heading: str) -> str:
    """The first ```python block after the line `heading` in README.md."""
    text = README.read_text()
    start = text.index(f"\n{heading}\n")
    found = re.search(r"```python\n(.*?)```", text[start:], re.DOTALL)
    assert found is not None, f"README.md has no python block under {heading!r}"
    return found.group(1)


def filled(code: str, **placeholders: str) -> str:
    """`code` with each placeholder replaced (keys: their text); each must be there."""
    for placeholder, value in placeholders.items():
        assert placeholder in code, f"the README snippet no longer names {placeholder!r}"
        code = code.replace(placeholder, value)
    return code


TRAINER_HEADING = "### Any PyTorch trainer (`syncd.member.attach`)"
RECEIVER_HEADING = "### Any vLLM engine (`generator_svc.attach`)"


def trainer_snippet(target: str) -> str:
    return filled(python_block(TRAINER_HEADING), **{SYNCD_PLACEHOLDER: target})
