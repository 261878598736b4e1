"""`syncd.member.attach` runs inside a user's trainer, where only torch and grpc are installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_attach_needs_no_http_stack():
    code = (
        "import sys, syncd.member.attach; "
        "print(sorted(m for m in ('pydantic', 'fastapi', 'httpx', 'vllm', 'trainer_svc') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stdout
