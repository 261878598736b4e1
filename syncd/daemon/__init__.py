"""The daemon: what `python -m syncd` runs. Members register here (`grpc_service`), the registry
and the versions they announce live here, the refit coordinator (`coordinator`, over `admission`,
`refit_sequence`, `auto_refit`, `refit_run` and `checks`) drives them and records every outcome
(`store`, `journal`), and operators use its HTTP API (`http_app`).
Members never import this package; they use `syncd.member`."""
