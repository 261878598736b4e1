"""Weight sync for vLLM engines users build themselves: an in-process `LLM` (`attach`), or a plain
`vllm serve` process (`WeightSyncMiddleware`, asked to attach by `attach_server`).

Runs in the user's process (the one holding the `LLM`) or in vLLM's own API-server process; it
drives the same refit lifecycle as `python -m generator_svc` (`generator_svc.server`'s `Refitter`
and internal routes) and checks that an engine was built with `generator_svc.worker`'s extension,
so it is the one package that imports both sides.

    from vllm import LLM
    from generator_svc import attach

    llm = LLM(model=..., **attach.ENGINE_ARGS)
    handle = attach.attach(llm, syncd="syncd-host:8471", replica=0)
"""

from generator_svc.attach.attached_llm import AttachedEngine, attach
from generator_svc.attach.engine_args import (
    ATTACH_ROUTE,
    ENGINE_ARGS,
    MIDDLEWARE,
    SERVE_FLAGS,
    AttachRefused,
    make_settings,
    refusals,
    refuse_unless_attachable,
)
from generator_svc.attach.serve_client import AttachedServer, attach_server
from generator_svc.attach.serve_middleware import WeightSyncMiddleware

__all__ = [
    "ATTACH_ROUTE",
    "ENGINE_ARGS",
    "MIDDLEWARE",
    "SERVE_FLAGS",
    "AttachRefused",
    "AttachedEngine",
    "AttachedServer",
    "WeightSyncMiddleware",
    "attach",
    "attach_server",
    "make_settings",
    "refusals",
    "refuse_unless_attachable",
]
