"""Regenerate the checked-in gRPC stubs from proto/: `python -m syncd.api.generate`.

protoc names the generated modules after the proto package (`weightsync.v1`), so the stubs are
generated into a scratch folder, their cross-import is rewritten to `syncd.api`, and they are
copied here. A test regenerates into a temp dir and compares, so the stubs never go stale.
"""

from __future__ import annotations

import argparse
import importlib.resources
import tempfile
from pathlib import Path

from grpc_tools import protoc

REPO = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO / "proto"
PROTO = "weightsync/v1/syncd.proto"
API_DIR = Path(__file__).resolve().parent
OUTPUTS = ("syncd_pb2.py", "syncd_pb2.pyi", "syncd_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs into `out_dir` and return their paths."""
    include = str(importlib.resources.files("grpc_tools") / "_proto")
    with tempfile.TemporaryDirectory() as scratch:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={scratch}",
            f"--pyi_out={scratch}",
            f"--grpc_python_out={scratch}",
            str(PROTO_ROOT / PROTO),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO}")
        generated = Path(scratch) / Path(PROTO).parent
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in OUTPUTS:
            text = (generated / name).read_text()
            text = text.replace("from weightsync.v1 import syncd_pb2", "from syncd.api import syncd_pb2")
            target = out_dir / name
            target.write_text(text)
            written.append(target)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=API_DIR, help="output folder (default: syncd/api)")
    for path in generate(parser.parse_args().out):
        print(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")


if __name__ == "__main__":
    main()
