"""A member process for `test_syncd_cuda_ipc.py`: a trainer rank or a generator worker on a GPU
that joins a real syncd (`syncd.member.join`) and answers the test on stdin:

    load V   (trainer)   hold the weights of version V and announce it; prints "loaded V"
    check V  (generator) compare the live weights with version V's; prints "ok V" or "bad V names"
    quit                 leave syncd and exit; prints "bye"

    python tests/gpu/ipc_member.py trainer|generator TARGET DEVICE
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from syncd.member import join
from syncd.plan.simulate import materialize
from syncd.vocabulary import Role
from testkit.endpoints import GeneratorEndpoint, TrainerEndpoint
from testkit.synthetic_moe import trainer_catalog, vllm_catalog
from tests.gpu.small_moe import SMALL_MOE, canonical


def main(role: str, target: str, device: str) -> None:
    if role == "trainer":
        endpoint = TrainerEndpoint(trainer_catalog(SMALL_MOE, 1, 0, 1, 0), device)
        who = {"role": Role.TRAINER, "member_id": "trainer-0", "coords": {"pp": 0, "dp": 0, "ep": 0, "tp": 0}}
    else:
        endpoint = GeneratorEndpoint(vllm_catalog(SMALL_MOE, 1, 0), device)
        who = {"role": Role.GENERATOR, "member_id": "generator-0-0", "coords": {"replica": 0, "tp": 0}}
    member = join(target, endpoint, catalog=endpoint.catalog, device=device, **who)  # type: ignore[arg-type]
    for line in sys.stdin:
        verb, _, arg = line.strip().partition(" ")
        if verb == "load":
            endpoint.load(canonical(int(arg)))
            member.client.announce_version(int(arg))
            print(f"loaded {arg}", flush=True)
        elif verb == "check":
            expected = materialize(endpoint.catalog, canonical(int(arg)))
            bad = [n for n, t in endpoint.params.items() if not np.array_equal(t.cpu().numpy(), expected[n])]
            print(f"ok {arg}" if not bad else f"bad {arg} {' '.join(bad)}", flush=True)
        elif verb == "quit":
            break
    member.close()
    print("bye", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
