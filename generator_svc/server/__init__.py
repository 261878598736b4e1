"""Code that runs in the generator's API-server process (`python -m generator_svc`), beside vLLM's
`AsyncLLM` engine client: the HTTP app and routes, the guard in front of the engine, the refit
lifecycle and its modes, the probes and the metrics.

It drives the workers only through vLLM's `collective_rpc("ws_...")` (`generator_svc.worker`'s
extension) and reads their status files; it never imports `generator_svc.worker` nor
`generator_svc.attach`. `generator_svc.attach` reuses its `Refitter` and internal routes for engines
users build themselves.
"""
