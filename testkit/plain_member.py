"""A syncd member process with plain tensors: a trainer rank or a generator worker of the
synthetic MoE (`testkit/synthetic_moe.py`), without torchrun or vLLM. Many replicas fit on a small
machine this way (fan-out benchmark and tests); the data plane, agent and client are the real ones.

    python -m testkit.plain_member --syncd 127.0.0.1:8471 --role trainer --ep 2 --ep-rank 0 \
        --tp 2 --tp-rank 1 --model tiny --announce-file /tmp/version
    python -m testkit.plain_member --syncd 127.0.0.1:8471 --role generator --replica 3 \
        --tp 1 --tp-rank 0 --model tiny --digest-file /tmp/gen-3-0.json

A trainer rank holds, for weight version N, the canonical values `canonical_values(shape, N)` and
announces N when `--announce-file` first holds N (the caller writes it, then waits for every
rank's `loaded_marker` before it starts a refit). A generator worker stages
what it receives and, after each commit, writes the SHA-256 of every local tensor to
`--digest-file`, so a test can compare every byte with the expected values. `--hold-begin-s S`
makes a member wait S seconds when a transfer starts (a stuck member, for failure tests).
`--rl-changed F --rl-versions A,B` makes versions A..B RL-like steps of the version before them
(a fraction F of the elements move by one bfloat16 step), for delta refits.
`--lean` generators receive into one set of tensors, without the test endpoint's staging checks
(benchmarks: the per-replica CPU then is the data plane's).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from syncd.auth import resolve_token
from syncd.member import join
from syncd.member.client import MemberClient
from syncd.plan.simulate import convert
from syncd.vocabulary import Role
from syncd.weight_version import WeightVersion
from testkit.endpoints import GeneratorEndpoint, TrainerEndpoint
from testkit.synthetic_moe import MoeShape, trainer_catalog, vllm_catalog

log = logging.getLogger("plain_member")

TINY = MoeShape(layers=2, hidden=64, experts=4, moe_inter=32, heads=4, kv_heads=2, head_dim=16, vocab=256)


def model_shape(name: str, mib: int) -> MoeShape:
    """`tiny` (a few hundred KB), or `moe`: Qwen3-MoE-like layers (hidden 512, 32 experts of 256)
    in bfloat16, as many as make about `mib` MiB."""
    if name == "tiny":
        return TINY
    base = MoeShape(
        layers=1, hidden=512, experts=32, moe_inter=256, heads=8, kv_heads=2, head_dim=64, vocab=8192
    )
    per_layer = sum(c.nbytes for c in base.canonical()) - 2 * base.vocab * base.hidden * 2
    layers = max(1, round((mib * 2**20 - 2 * base.vocab * base.hidden * 2) / per_layer))
    return MoeShape(**{**base.__dict__, "layers": layers})


def canonical_values(shape: MoeShape, version: int) -> dict[str, np.ndarray]:
    """Version `version`'s weights: seeded normal values, as bfloat16 bit patterns (int16)."""
    rng = np.random.default_rng(version)
    out = {}
    for c in shape.canonical():
        values = rng.standard_normal(c.shape, dtype=np.float32)
        out[c.name] = convert(values, "float32", c.dtype).view(np.int16) if c.dtype == "bfloat16" else values
    return out


def rl_step(values: dict[str, np.ndarray], fraction: float, version: int) -> dict[str, np.ndarray]:
    """An RL-like step to `version`: `fraction` of the elements move by one bfloat16 step (their
    bits change, the rest keep theirs), seeded by `version` so every rank takes the same step."""
    rng = np.random.default_rng(1_000_000 + version)
    out = {}
    for name, bits in values.items():
        moved = bits.copy()
        hit = rng.random(bits.shape, dtype=np.float32) < fraction
        moved[hit] += 1  # int16 bit patterns of bfloat16 values (floats: a tiny change)
        out[name] = moved
    return out


def tensor_digests(tensors) -> dict[str, str]:
    return {
        name: hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
        for name, t in tensors.items()
    }


class _Holding:
    """Wraps an endpoint so that `begin` waits `hold_s` first from version `from_version` on (a
    member stuck at a transfer)."""

    def __init__(self, inner, hold_s: float, from_version: int) -> None:
        self._inner, self._hold_s, self._from_version = inner, hold_s, from_version

    def begin(self, refit_id, version, buckets):
        if version >= self._from_version:
            log.warning("holding %.0f s before the transfer of %s", self._hold_s, refit_id)
            time.sleep(self._hold_s)
        return self._inner.begin(refit_id, version, buckets)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _Digesting(GeneratorEndpoint):
    """A generator worker that writes its tensors' digests after every commit."""

    def __init__(self, catalog, digest_file: Path | None) -> None:
        super().__init__(catalog)
        self.digest_file = digest_file

    def commit(self, refit_id, version, timeout_s):
        super().commit(refit_id, version, timeout_s)
        if self.digest_file is not None:
            tmp = self.digest_file.with_suffix(".tmp")
            body = {"refit": refit_id, "version": int(version), "sha256": tensor_digests(self.params)}
            tmp.write_text(json.dumps(body))
            os.replace(tmp, self.digest_file)


class _LeanGenerator(GeneratorEndpoint):
    """For benchmarks: one set of tensors received into refit after refit (no staging fill, no
    scan for unwritten elements, no second copy; syncd's checksums still cover every byte), so
    that eight replicas on two cores measure the refit, not the stand-in's bookkeeping."""

    def __init__(self, catalog) -> None:
        super().__init__(catalog)
        self.staging = self.params

    def begin(self, refit_id, version, buckets):
        return self.params

    def verify(self, refit_id):
        pass

    def commit(self, refit_id, version, timeout_s):
        self.version = version

    def abort(self):
        pass


@dataclass(frozen=True)
class RlSteps:
    """Versions `first` .. `last` are RL-like steps (`rl_step`, `fraction` of the elements) of the
    version before them; every other version is its own random values (everything changes)."""

    fraction: float = 0.0
    first: int = 0
    last: int = -1

    def values(self, shape: MoeShape, version: int, previous: dict[str, np.ndarray] | None):
        """Version `version`'s canonical values; `previous`: version - 1's, if the caller has them."""
        if not self.first <= version <= self.last:
            return canonical_values(shape, version)
        if previous is None:
            previous = self.values(shape, version - 1, None)
        return rl_step(previous, self.fraction, version)


def loaded_marker(announce_file: Path, member_id: str) -> Path:
    """Where trainer `member_id` writes the version it holds and announced. syncd takes one rank's
    announcement as the version being held (real trainers announce after a step every rank took);
    plain ranks load at their own pace, so callers wait for every rank's marker before a refit."""
    return announce_file.with_name(f"{announce_file.name}.{member_id}")


def _announce_loop(
    client: MemberClient, endpoint: TrainerEndpoint, shape: MoeShape, path: Path, stop, steps: RlSteps
) -> None:
    announced, values = 0, None
    while not stop.is_set():
        try:
            wanted = int(path.read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            wanted = 0
        if wanted > announced:
            values = steps.values(shape, wanted, values if announced == wanted - 1 else None)
            endpoint.load(values)
            client.announce_version(WeightVersion(wanted))
            loaded_marker(path, client.member_id).write_text(str(wanted))
            announced = wanted
            log.info("announced version %d", wanted)
        stop.wait(0.1)


def _rl_steps(args: argparse.Namespace) -> RlSteps:
    first, last = (int(v) for v in args.rl_versions.split(","))
    return RlSteps(args.rl_changed, first, last)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--syncd", required=True, help="syncd's gRPC HOST:PORT")
    p.add_argument("--role", choices=("trainer", "generator"), required=True)
    p.add_argument("--model", choices=("tiny", "moe"), default="tiny")
    p.add_argument("--mib", type=int, default=160, help="model size for --model moe")
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--ep-rank", type=int, default=0)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--tp-rank", type=int, default=0)
    p.add_argument("--replica", type=int, default=0)
    p.add_argument("--host", default="127.0.0.1", help="address this member's data plane binds")
    p.add_argument("--announce-file", type=Path, help="trainers: announce the version this file holds")
    p.add_argument("--digest-file", type=Path, help="generators: write tensor digests here on commit")
    p.add_argument("--lean", action="store_true", help="generators: no staging copy (benchmarks)")
    p.add_argument("--hold-begin-s", type=float, default=0.0, help="wait this long when a transfer starts")
    p.add_argument("--hold-from-version", type=int, default=0, help="... from this weight version on")
    p.add_argument("--rl-changed", type=float, default=0.0, help="trainers: elements an RL-like step moves")
    p.add_argument(
        "--rl-versions",
        default="0,-1",
        help="trainers: FIRST,LAST versions that are RL-like steps (--rl-changed)",
    )
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.role} %(name)s: %(message)s")
    shape = model_shape(args.model, args.mib)
    if args.role == "trainer":
        rank = args.ep_rank * args.tp + args.tp_rank
        member_id = f"trainer-{rank}"
        coords = {"pp": 0, "dp": 0, "ep": args.ep_rank, "tp": args.tp_rank}
        endpoint = TrainerEndpoint(trainer_catalog(shape, args.ep, args.ep_rank, args.tp, args.tp_rank))
    else:
        member_id = f"generator-{args.replica}-{args.tp_rank}"
        coords = {"replica": args.replica, "tp": args.tp_rank}
        catalog = vllm_catalog(shape, args.tp, args.tp_rank)
        endpoint = _LeanGenerator(catalog) if args.lean else _Digesting(catalog, args.digest_file)
    membership = join(
        args.syncd,
        _Holding(endpoint, args.hold_begin_s, args.hold_from_version) if args.hold_begin_s else endpoint,
        role=Role(args.role),
        member_id=member_id,
        coords=coords,
        catalog=endpoint.catalog,
        data_host=args.host,
        auth_token=resolve_token(),  # SYNCD_AUTH_TOKEN_FILE or SYNCD_AUTH_TOKEN, as every member
        weight_version=WeightVersion(0) if args.role == "generator" else None,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if args.role == "trainer" and args.announce_file is not None:
        threading.Thread(
            target=_announce_loop,
            args=(membership.client, endpoint, shape, args.announce_file, stop, _rl_steps(args)),
            daemon=True,
        ).start()
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        membership.close()
        logging.shutdown()
        os._exit(0)  # not waiting for a transfer thread a stuck peer holds (it holds nothing to save)


if __name__ == "__main__":
    main()
