"""Run under torchrun (4 gloo ranks): `attach` refuses, before it registers anything and on every
rank alike, a model holding a `Partial` parameter, a `_StridedShard` whose split factor is not
FSDP2's, a parameter no rule names and a mapping of the wrong shape. Rank r writes the error
text to argv[1] + f".{r}". No syncd runs: a refused attach must never reach it."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from syncd.layout import Canon
from syncd.member.attach import LayoutRefusedError, attach


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2))
    model = torch.nn.Module()
    params = {
        "model.norm.weight": torch.ones(8),  # fine: plain, replicated
        "model.layers.0.self_attn.q_proj.weight": distribute_tensor(
            torch.ones(8, 4), mesh, [Shard(0), Shard(1)]
        ),
        "model.partial.weight": DTensor.from_local(torch.ones(4), mesh, [Partial(), Shard(0)]),
        "model.strided.weight": distribute_tensor(
            torch.ones(8, 4), mesh, [_StridedShard(0, split_factor=3), Shard(1)], src_data_rank=None
        ),
        "encoder.unnamed": torch.ones(3),
        "model.renamed.weight": torch.ones(2, 2),
    }
    for name, p in params.items():
        model.register_parameter(name.replace(".", "_"), torch.nn.Parameter(p))
    # named_parameters() names by attribute; give the refusals the names a user would see
    named = dict(zip(params, model.parameters()))
    model.named_parameters = lambda *a, **k: iter(named.items())  # type: ignore[method-assign]
    try:
        attach(model, syncd="127.0.0.1:9")
    except LayoutRefusedError as e:
        text = str(e)
    else:
        text = "attach did not refuse"
    # the rest excluded or mapped, a mapping of the wrong shape is what is left to refuse
    names = {
        "encoder.unnamed": "model.encoder_proj.weight",
        "model.renamed.weight": Canon("model.other.weight", (3, 3)),
    }
    try:
        attach(
            model, syncd="127.0.0.1:9", names=names, exclude=["model.partial.weight", "model.strided.weight"]
        )
    except LayoutRefusedError as e:
        text += "\n---\n" + str(e)
    with open(f"{sys.argv[1]}.{dist.get_rank()}", "w") as f:
        f.write(text)
    print(f"rank {dist.get_rank()}: refusals written", flush=True)  # in the test's output on a failure
    # Every rank done before any leaves; then leave without the interpreter's teardown. A rank
    # aborted in it now and then in CI ('terminate called without an active exception', after
    # writing its refusals, with a barrier and destroy_process_group before): a thread of torch's
    # C++ side still running when the process exits. Nothing of this script runs in its teardown,
    # and `attach` refuses before it starts anything of its own (no thread, no connection).
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
