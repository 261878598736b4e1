"""`generator_svc.attach` without an engine: which engine arguments it refuses, on the `VllmConfig`
vLLM itself builds from them (the config an `LLM` or `vllm serve` would run with), and that
`SERVE_FLAGS` are flags `vllm serve` parses into those arguments. Attaching real engines, and the
refusals of a real `vllm serve`: tests/e2e/test_attach_e2e.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from generator_svc.attach import (
    ENGINE_ARGS,
    MIDDLEWARE,
    SERVE_FLAGS,
    AttachRefused,
    attach,
    make_settings,
    refusals,
)
from generator_svc.attach.__main__ import main
from generator_svc.worker import WeightSyncExtension


class FrameworkExtension(WeightSyncExtension):
    """An RL framework's own worker extension that mixes weight sync in."""


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from trainer_svc.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("model"), seed=0)


def _config(model: Path, **engine_args: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=str(model), skip_tokenizer_init=True, enforce_eager=True, max_model_len=256, **engine_args
    ).create_engine_config()


EXTENSION = "generator_svc.worker.WeightSyncExtension"
TRANSFER = {"backend": "syncd_staging"}


@pytest.mark.parametrize(
    "engine_args,refused",
    [
        (ENGINE_ARGS, []),
        ({**ENGINE_ARGS, "worker_extension_cls": f"{__name__}.FrameworkExtension"}, []),
        (
            {},
            [
                (
                    r"worker_extension_cls \(--worker-extension-cls\) is '': weight sync needs "
                    r"'generator_svc\.worker\.WeightSyncExtension' or a subclass of it"
                ),
                (
                    r"weight_transfer_config \(--weight-transfer-config\) is not set: weight sync "
                    r"needs \{'backend': 'syncd_staging'\}"
                ),
            ],
        ),
        (
            {"worker_extension_cls": EXTENSION, "weight_transfer_config": {"backend": "nccl"}},
            [r"weight_transfer_config \(--weight-transfer-config\) is backend 'nccl'"],
        ),
        (
            {"worker_extension_cls": "json.JSONDecoder", "weight_transfer_config": TRANSFER},
            [r"worker_extension_cls \(--worker-extension-cls\) is 'json\.JSONDecoder'"],
        ),
        (
            {"worker_extension_cls": "no_such_module.Extension", "weight_transfer_config": TRANSFER},
            [r"worker_extension_cls \(--worker-extension-cls\) is 'no_such_module\.Extension'"],
        ),
    ],
    ids=["ours", "a-subclass", "neither", "nccl-backend", "another-extension", "unimportable"],
)
def test_refusals_name_each_missing_engine_argument(
    model: Path, engine_args: dict, refused: list[str]
) -> None:
    problems = refusals(_config(model, **engine_args))
    assert len(problems) == len(refused), problems
    for problem, pattern in zip(problems, refused):
        assert re.search(pattern, problem), (pattern, problem)


def test_serve_flags_are_what_vllm_serve_parses_into_the_engine_arguments(model: Path) -> None:
    from vllm.engine.arg_utils import EngineArgs

    from generator_svc.vllm_adapter import FlexibleArgumentParser, make_arg_parser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", str(model), *SERVE_FLAGS])
    assert args.middleware == [MIDDLEWARE]
    config = EngineArgs.from_cli_args(args)
    assert (config.worker_extension_cls, config.weight_transfer_config.backend) == (
        EXTENSION,
        "syncd_staging",
    )


def test_the_flags_print_as_one_shell_word_each(capsys: pytest.CaptureFixture[str]) -> None:
    assert main() == 0
    assert capsys.readouterr().out.split() == SERVE_FLAGS


def test_attach_takes_only_vllms_llm_and_valid_settings() -> None:
    with pytest.raises(
        AttachRefused, match="attach takes vLLM's LLM, got dict; for a server use attach_server"
    ):
        attach({}, syncd="127.0.0.1:1")
    with pytest.raises(ValueError, match="syncd must be syncd's gRPC address"):
        make_settings("")
    with pytest.raises(ValueError, match="'sideways' is not a valid RefitMode"):
        make_settings("127.0.0.1:1", refit_mode="sideways")
    with pytest.raises(ValueError, match="replica must be >= 0, got -1"):
        make_settings("127.0.0.1:1", -1)
    assert make_settings("127.0.0.1:1", refit_mode="inplace").in_flight_buckets == 1


def test_the_middleware_passes_vllms_paths_through_and_refuses_relays_before_attach() -> None:
    """Before `POST /weightsync/attach`: vLLM's paths reach vLLM's app untouched, a relay of
    syncd's commands is refused (409), and the status says not attached."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from generator_svc.attach import WeightSyncMiddleware

    vllm_app = FastAPI()  # stands in for vLLM's app: the middleware only routes around it

    @vllm_app.post("/v1/completions")
    def completions() -> dict:
        return {"from": "vllm"}

    vllm_app.add_middleware(WeightSyncMiddleware)
    with TestClient(vllm_app) as client:
        assert client.post("/v1/completions").json() == {"from": "vllm"}
        assert client.get("/weightsync/status").json() == {"attached": False}
        relay = client.post("/internal/commit", json={"refit_id": "r", "version": 1, "timeout_s": 5})
        assert relay.status_code == 409
        assert (
            "weight sync is not attached (POST /weightsync/attach first)" in relay.json()["error"]["message"]
        )


def test_a_server_with_api_keys_guards_the_attach_route_with_them() -> None:
    """vLLM checks `--api-key` in a middleware inside ours, so the routes of weight sync check the
    same keys themselves; vLLM's own paths are left to vLLM."""
    from argparse import Namespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from generator_svc.attach import WeightSyncMiddleware

    vllm_app = FastAPI()
    vllm_app.state.args = Namespace(api_key=["first", "second"])

    @vllm_app.get("/health")
    def health() -> dict:
        return {"from": "vllm"}

    vllm_app.add_middleware(WeightSyncMiddleware)
    with TestClient(vllm_app) as client:
        assert client.get("/health").json() == {"from": "vllm"}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic second"}):
            refused = client.post("/weightsync/attach", json={"syncd": "127.0.0.1:1"}, headers=headers)
            assert refused.status_code == 401
            assert "needs one of this server's API keys" in refused.json()["error"]["message"]
            assert client.get("/weightsync/status", headers=headers).status_code == 401
        keyed = {"Authorization": "Bearer second"}
        assert client.get("/weightsync/status", headers=keyed).json() == {"attached": False}
        # Past the key check: the body is validated (a replica below 0 is refused).
        invalid = client.post("/weightsync/attach", json={"syncd": "x:1", "replica": -1}, headers=keyed)
        assert invalid.status_code == 422
