"""Fixtures shared by the tests and the benchmarks (`bench/`); neither imports the other, both
import this. Not part of the installed package: tests run with the repository on `sys.path`
(pytest's `pythonpath = ["."]`) and benchmarks run from the repository root.

- `synthetic_moe`: a synthetic Qwen3-MoE-shaped model as catalogs (expert-TP trainer layout,
  vLLM's layout), sized by layer count or by GiB (`shape_for`), and a one-GPU colocated plan;
- `endpoints`: member endpoints with plain tensors (a trainer rank's, a generator worker's);
- `plain_member`: a member process (`python -m testkit.plain_member`) that registers with a real
  syncd and serves refits of the synthetic MoE without torchrun or vLLM;
- `loopback_transport`: a wire on one GPU (a device copy) and a wire that moves nothing;
- `four_to_one`: four trainer ranks and one receiver, each a process, over gloo;
- `worker_aids`: functions run inside a vLLM worker (`LLM.collective_rpc`) to dump or install
  checkpoints without a network.
"""
