"""trainer_svc: expert-TP MoE training (pipeline x data x expert x tensor parallel) of a Qwen3-MoE.

Layout of the package (torchtitan-like):
- `config.py` model arguments parsed from an HF `config.json`; `settings.py` the one settings object.
- `model.py`, `moe.py`, `dispatch.py` the model with local (sharded) parameter shapes.
- `parallel_dims.py` the mesh; `comm.py` collectives with autograd; `parallelize.py` the recipe
  that builds one rank's pipeline stage; `pipeline.py` the microbatch schedule.
- `canonical.py` the canonical tensors (names, shapes, random init); `hf_checkpoint.py` HF
  directories <-> canonical tensors, in the dtypes of `export_dtype.py`; `shard_cut.py` /
  `shard_gather.py` canonical tensors <-> a rank's parameters; `sharded_io.py` and
  `parallel_export.py` the per-rank load and export; `catalog.py` the syncd layout of a rank.
- `train.py` the training loop; `agent.py` the syncd rank agent; `tiny.py` a tiny test checkpoint.

Nothing here imports vllm.
"""
