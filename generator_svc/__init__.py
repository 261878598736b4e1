"""generator_svc: a vLLM generator that registers its parameter layout with syncd and takes new
weights while it serves.

Split where its processes split:

- `server/`: the API-server process of `python -m generator_svc` (HTTP, the guard in front of the
  engine, the refit lifecycle driven through vLLM's engine client, probes, metrics);
- `worker/`: inside vLLM's worker processes (the worker extension vLLM loads as
  `generator_svc.worker.WeightSyncExtension`, the syncd member, staging and the install);
- `attach/`: weight sync for engines users build themselves (an `LLM`, a plain `vllm serve`).

Shared by all three, at this level: `settings` (the settings and the mode enums), `worker_protocol`
(the typed messages between the API server and the workers) and `vllm_adapter` (every vLLM internal
used). `server` and `worker` never import each other; `attach` uses both.
"""
