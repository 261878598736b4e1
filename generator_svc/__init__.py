"""generator_svc: a vLLM generator that registers its parameter layout with syncd and takes new
weights while it serves.

Layout: `catalog` (pure: vLLM parameter specs -> syncd catalog), `vllm_layout` (reads the specs from
a live vLLM model), `staging` (receive buffers and feeding vLLM's loaders), `worker` (the vLLM worker
extension and its weight-transfer engine), `refit` (the engine-level update lifecycle), `server`
(HTTP), `settings`, `metrics`;
`attach` (weight sync for a vLLM engine the user created: an `LLM`, or `vllm serve` with the
middleware of `attach_serve`).
"""
