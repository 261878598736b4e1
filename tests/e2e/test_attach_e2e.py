"""End to end: vLLM engines a user created, attached to syncd with `generator_svc.attach`, take
refits from trainer_svc.

Two receivers of the same two refits of a one-rank trainer job: an in-process `LLM`
(examples/attach_llm.py in `--syncd` mode, replica 0: `LLM(..., **ENGINE_ARGS)` then `attach`)
and a plain `vllm serve` process started with `SERVE_FLAGS` and attached over HTTP
(`attach_server`, replica 1). After each refit both generate exactly (greedy tokens and logprobs)
as a fresh vLLM started on that step's export. The fresh engines are plain `vllm serve`
processes too, and then show the refusals: one has none of weight sync's flags (no middleware),
the other only the middleware (no worker extension, no transfer engine).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from e2e_harness import GENERATOR_FLAGS, Stack, wait_until

from deploy.local import openai_client
from deploy.local.processes import PYTHON, REPO, Proc
from syncd import http_client
from syncd.net import free_port
from syncd.weight_version import Version

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

EXAMPLE = REPO / "examples" / "attach_llm.py"
STEPS = 2
Outputs = list[tuple[list[int], list[float]]]  # per prompt: greedy tokens, their logprobs


@dataclass
class Refitted:
    llm: dict[int, Outputs]  # version -> outputs of the attached in-process LLM
    served: dict[int, Outputs]  # version -> outputs of the attached `vllm serve`
    background: list[Outputs]  # the attached LLM's completions from a thread, during the refits
    served_url: str
    prompts: list[list[int]]
    max_tokens: int
    export: Path


def _start_vllm_serve(
    stack: Stack, name: str, model: Path, flags: list[str], cpus: str | None = None
) -> tuple[Proc, str]:
    """`cpus`: the worker's OpenMP binding (VLLM_CPU_OMP_THREADS_BIND; default: the core of this
    xdist worker's engines, tests/conftest.py)."""
    port = free_port()
    command = [PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port)]
    env = {"VLLM_CPU_OMP_THREADS_BIND": cpus} if cpus else {}
    proc = stack.cluster.start(name, [*command, "--dtype", "bfloat16", *GENERATOR_FLAGS, *flags], env=env)
    return proc, f"http://127.0.0.1:{port}"


def _greedy(url: str, prompts: list[list[int]], max_tokens: int) -> Outputs:
    api = openai_client.client(url)
    return [openai_client.complete(api, "tiny", p, max_tokens=max_tokens, temperature=0) for p in prompts]


def _as_outputs(recorded: list[dict]) -> Outputs:
    return [(o["tokens"], o["logprobs"]) for o in recorded]


def _recorded(record: Path, version: int, llm: Proc) -> dict:
    """The example's line for `version` (it appends one per version it serves)."""

    def line() -> dict | None:
        assert llm.alive() or record.exists(), f"the attached LLM exited:\n{llm.tail(60)}"
        lines = record.read_text().splitlines() if record.exists() else []
        return json.loads(lines[version]) if len(lines) > version else None

    found = wait_until(line, 300, f"the attached LLM serving version {version}")
    assert isinstance(found, dict) and found["version"] == version, found
    return found


@pytest.fixture(scope="module")
def refitted(stack: Stack, model: Path, tmp_path_factory) -> Refitted:
    from generator_svc.attach import SERVE_FLAGS, attach_server

    work = tmp_path_factory.mktemp("attach")
    stack.start_syncd(trainers=1, generators=2)
    # The example's LLM keeps generating on a thread, and its worker busy-waits for a second after
    # each step: it gets core 0 and the served engine's worker core 1, whichever core the xdist
    # worker's engines get (tests/conftest.py).
    served, served_url = _start_vllm_serve(stack, "served", model, SERVE_FLAGS, cpus="1")
    record = work / "llm.jsonl"
    llm = stack.cluster.start(
        "attached-llm",
        [PYTHON, str(EXAMPLE), "--syncd", stack.target, "--model", str(model), "--replica", "0",
         "--steps", str(STEPS), "--record", str(record)],
        env={"VLLM_CPU_OMP_THREADS_BIND": "0"},
    )  # fmt: skip
    stack.cluster.wait_http(served, f"{served_url}/health", 300)
    attached = attach_server(served_url, syncd=stack.target, replica=1)
    assert [w["member_id"] for w in attached.workers] == ["generator-1-0"]

    first = _recorded(record, 0, llm)
    prompts, max_tokens = first["prompts"], first["max_tokens"]
    recorded = {0: first}
    outputs = {0: _greedy(served_url, prompts, max_tokens)}
    trainer = stack.train(model, pp=1, ep=1, tp=1, steps=STEPS, export=work / "export")
    for version in range(1, STEPS + 1):
        stack.wait_announced(version)
        state = stack.refit(version)
        assert state["state"] == "COMMITTED", state
        recorded[version] = _recorded(record, version, llm)
        assert attached.wait_version(version, exact=True, timeout_s=60) == Version.of(version)
        outputs[version] = _greedy(served_url, prompts, max_tokens)
    assert trainer.popen.wait(180) == 0, trainer.tail()
    assert llm.popen.wait(120) == 0, llm.tail(60)  # it detached (left syncd) and exited
    background = json.loads(record.read_text().splitlines()[STEPS + 1])["background"]
    return Refitted(
        llm={v: _as_outputs(r["outputs"]) for v, r in recorded.items()},
        served=outputs,
        background=[_as_outputs(b) for b in background],
        served_url=served_url,
        prompts=prompts,
        max_tokens=max_tokens,
        export=work / "export",
    )


@pytest.fixture(scope="module")
def fresh(stack: Stack, refitted: Refitted) -> dict[int, str]:
    """version -> URL of a fresh `vllm serve` on that step's export: step 1's with none of weight
    sync's flags, step 2's with only the middleware (neither changes what vLLM generates)."""
    from generator_svc.attach import MIDDLEWARE

    flags = {1: [], 2: ["--middleware", MIDDLEWARE]}
    started = {
        v: _start_vllm_serve(stack, f"fresh-{v}", refitted.export / f"step-{v}", flags[v])
        for v in range(1, STEPS + 1)
    }
    for proc, url in started.values():
        stack.cluster.wait_http(proc, f"{url}/health", 300)
    return {v: url for v, (_, url) in started.items()}


def test_an_attached_llm_and_vllm_serve_take_two_refits_exactly_as_fresh_engines(
    refitted: Refitted, fresh: dict[int, str]
) -> None:
    for version in range(1, STEPS + 1):
        expected = _greedy(fresh[version], refitted.prompts, refitted.max_tokens)
        assert refitted.llm[version] == expected, f"the attached LLM at version {version}"
        assert refitted.served[version] == expected, f"the attached vllm serve at version {version}"
        # each step moved the weights, and each refit moved what the engines generate
        assert refitted.llm[version] != refitted.llm[version - 1]
    assert refitted.llm[0] == refitted.served[0]  # both started on the same checkpoint
    # A thread of the example generated all along: each completion is what one version generates.
    assert refitted.background
    for outputs in refitted.background:
        for i, completion in enumerate(outputs):
            assert completion in [refitted.llm[v][i] for v in refitted.llm], (i, completion)
    status = http_client.get(f"{refitted.served_url}/weightsync/status").json()
    served = (status["version"], status["step"], status["serving"], status["updating"])
    assert served == (str(STEPS), STEPS, True, False), status


def test_attaching_is_refused_naming_what_the_engine_lacks(
    stack: Stack, refitted: Refitted, fresh: dict[int, str]
) -> None:
    from generator_svc.attach import AttachRefused, attach_server

    middleware = r"start it with --middleware generator_svc\.attach\.WeightSyncMiddleware"
    with pytest.raises(AttachRefused, match=middleware):
        attach_server(fresh[1], syncd=stack.target, replica=2)
    lacking = (
        r"worker_extension_cls \(--worker-extension-cls\) is '': weight sync needs "
        r"'generator_svc\.worker\.WeightSyncExtension'.*weight_transfer_config "
        r"\(--weight-transfer-config\) is not set"
    )
    with pytest.raises(AttachRefused, match=lacking):
        attach_server(fresh[2], syncd=stack.target, replica=2)
    with pytest.raises(AttachRefused, match=r"already attached as replica 1 of syncd"):
        attach_server(refitted.served_url, syncd=stack.target, replica=3)
    members = [m["member_id"] for m in stack.http.get("/v1/members").json()["members"]]
    assert not [m for m in members if m.startswith(("generator-2-", "generator-3-"))], members
