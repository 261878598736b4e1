"""How a refit meets running requests (`--pause-mode keep|abort`) and the weight versions every
completion reports, on real vLLM engines (CPU): one generator per mode, started together and shared
by the checks of this module; the `keep` one at TP 2 (its pause and switch act on both workers), the
`abort` one at TP 1. `wait` (the default) is what every other generator test runs.

A long greedy request streams from checkpoint A, a plain one joins it, and the staged checkpoint B
is applied while both run, so both span the refit.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.generator.conftest import Service, engine_env
from tests.polling import wait_until

PROMPT = [3, 14, 15, 92, 65]
# Requests as long as the tiny model allows (its max_position_embeddings), so that a refit meets
# them running even where the frontend that serves the test's calls is slow to get the CPU.
MODEL_LEN = 512
LONG = MODEL_LEN - 8  # output tokens: nearly the whole model length with the prompt
# Tries to have both requests run at once (`_start_both`).
_ATTEMPTS = 3


def _body(prompt: list[int], max_tokens: int, **extra: object) -> dict:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,
        "detokenize": False,
        "return_tokens_as_token_ids": True,
        **extra,
    }


def _tokens(logprobs: dict) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]


class Stream:
    """A streamed completion read on a thread: its tokens as they come, and its last chunk.

    It and `Call` use the service's client: a client made per request builds an SSL context,
    which takes seconds of CPU while the engine runs on a 2-core machine, and the request leaves late.
    """

    def __init__(self, service: Service, prompt: list[int], max_tokens: int) -> None:
        self.tokens: list[int] = []
        self.last: dict = {}
        self.status = 0
        self.finished = False  # its response has ended (a last chunk, an error or a closed stream)
        self._thread = threading.Thread(target=self._read, args=(service, prompt, max_tokens))
        self._thread.start()

    def _read(self, service: Service, prompt: list[int], max_tokens: int) -> None:
        body = _body(prompt, max_tokens, stream=True)
        try:
            with service.http.stream("POST", "/v1/completions", json=body) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line.removeprefix("data: "))
                        self.tokens += _tokens(chunk["choices"][0]["logprobs"] or {"tokens": []})
                        self.last = chunk
        finally:
            self.finished = True

    def join(self) -> dict:
        self._thread.join(120)
        return self.last


class Call:
    """A plain (not streamed) completion on a thread."""

    def __init__(self, service: Service, prompt: list[int], max_tokens: int) -> None:
        self.response: httpx.Response | None = None
        self._thread = threading.Thread(target=self._post, args=(service, _body(prompt, max_tokens)))
        self._thread.start()

    def _post(self, service: Service, body: dict) -> None:
        self.response = service.http.post("/v1/completions", json=body)

    def join(self) -> httpx.Response:
        self._thread.join(120)
        assert self.response is not None
        return self.response


@pytest.fixture(scope="module")
def services(checkpoints, tmp_path_factory) -> Iterator[dict[str, Service]]:
    logs = tmp_path_factory.mktemp("pause-logs")
    tp2 = ("--tensor-parallel-size", "2")  # one core per worker (vLLM binds a TP-N engine by NUMA node)
    long = ("--max-model-len", str(MODEL_LEN))  # the last one given is the one vLLM takes
    started = {
        "keep": Service(
            checkpoints["A"], logs / "keep.log", "--pause-mode", "keep", *tp2, *long,
            env=engine_env(VLLM_CPU_OMP_THREADS_BIND="0|1"),
        ),
        "abort": Service(checkpoints["A"], logs / "abort.log", "--pause-mode", "abort", *long),
    }  # fmt: skip
    try:
        yield {mode: s.wait_ready() for mode, s in started.items()}
    finally:
        for s in started.values():
            s.stop()


def _refit_during_requests(service: Service, checkpoint: str, version: str) -> tuple[Call, Stream]:
    """Refit `service` to `checkpoint` as `version` while a streamed and a plain request both run.

    Staging comes first: it reads the checkpoint, which on a loaded machine may take longer than a
    whole request. The plain request starts once the stream has its first tokens (started together,
    one may finish before the other reaches the engine), and the refit is applied once both run.
    vLLM's gauge of running requests keeps its last value while the engine idles, so each request's
    own state is checked too."""
    staged = service.http.post("/v1/weights/stage", json={"path": checkpoint, "refit_id": version})
    assert staged.status_code == 200, staged.text
    for _ in range(_ATTEMPTS):
        running = _start_both(service)
        if running is not None:
            applied = service.http.post("/v1/weights/apply", json={"version": version, "refit_id": version})
            assert applied.status_code == 200, applied.text
            return running
    raise AssertionError(f"the two requests never ran together in {_ATTEMPTS} attempts")


def _start_both(service: Service) -> tuple[Call, Stream] | None:
    """A stream, then a plain request once the stream has its first tokens; both once both run, or
    None (after their ends) when one ended before the other ran: on a loaded machine the stream
    may end before the plain request reaches the engine (CI saw it)."""
    stream = Stream(service, PROMPT, LONG)
    wait_until(lambda: len(stream.tokens) >= 4, what="the stream's first tokens")
    plain = Call(service, PROMPT, LONG)

    def one_ended() -> bool:
        return plain.response is not None or stream.finished

    def both_running() -> bool:
        return not one_ended() and _running(service) >= 2

    wait_until(lambda: both_running() or one_ended(), timeout=120, what="both requests running")
    if both_running():
        return plain, stream
    plain.join(), stream.join()
    return None


def _running(service: Service) -> float:
    """vLLM's gauge of the requests its engine runs now (one series per engine)."""
    found = re.findall(
        r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+]+)$", service.http.get("/metrics").text, re.M
    )
    return sum(float(v) for v in found)


def _metric(service: Service, name: str) -> float:
    m = re.search(rf"^{name} ([0-9.e+]+)$", service.http.get("/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def test_keep_continues_running_requests_on_the_new_weights_and_says_from_which_token(
    services, checkpoints
) -> None:
    keep = services["keep"]
    before = keep.http.post("/v1/completions", json=_body(PROMPT, LONG))
    assert before.status_code == 200, before.text
    old_only = _tokens(before.json()["choices"][0]["logprobs"])
    assert before.json()["choices"][0]["weight_versions"] == [{"version": "0", "start": 0, "end": LONG}]
    assert before.headers["x-weight-version"] == "0"

    plain, stream = _refit_during_requests(keep, str(checkpoints["B"]), "b")
    answer, last = plain.join(), stream.join()

    # The stream: its last chunk carries the spans; tokens before the switch are the old weights'.
    spans = last["choices"][0]["weight_versions"]
    assert stream.status == 200 and last["choices"][0]["finish_reason"] == "length"
    assert [s["version"] for s in spans] == ["0", "b"], spans
    switch = spans[1]["start"]
    assert spans == [
        {"version": "0", "start": 0, "end": switch},
        {"version": "b", "start": switch, "end": LONG},
    ]
    assert 0 < switch < LONG and len(stream.tokens) == LONG
    assert stream.tokens[:switch] == old_only[:switch]
    # From the switch on, B chose: its greedy choice after the same tokens differs from A's here,
    # and is what the request got.
    b_next = keep.complete(PROMPT + stream.tokens[:switch], max_tokens=1)[0][0]
    assert b_next != old_only[switch], "the test needs weights whose greedy choice differs"
    assert stream.tokens[switch] == b_next

    # The plain request spanned it too: its body and header say so.
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    plain_spans = choice["weight_versions"]
    assert [s["version"] for s in plain_spans] == ["0", "b"]
    plain_switch = plain_spans[1]["start"]
    assert answer.headers["x-weight-version"] == f"0@0,b@{plain_switch}"
    assert _tokens(choice["logprobs"])[:plain_switch] == old_only[:plain_switch]

    # What the generator records: the pause, and both requests as spanning refit b.
    history = keep.http.get("/v1/install").json()
    assert history["pause_mode"] == "keep"
    (entry,) = [e for e in history["history"] if e["version"] == "b"]
    assert entry["spanning_requests"] == 2 and 0 < entry["install_s"] <= entry["pause_s"]
    assert _metric(keep, "weightsync_generator_spanning_requests_total") == 2

    # A request that starts after the refit is B's alone.
    after = keep.http.post("/v1/completions", json=_body(PROMPT, 8))
    assert after.headers["x-weight-version"] == "b"
    assert after.json()["choices"][0]["weight_versions"] == [{"version": "b", "start": 0, "end": 8}]


def test_abort_ends_running_requests_with_a_retryable_error_and_nothing_else_fails(
    services, checkpoints
) -> None:
    abort = services["abort"]
    version, answer, stream, last = _abort_during_requests(abort, checkpoints)

    assert answer.status_code == 503, answer.text
    assert answer.headers["retry-after"] == "1"
    assert "aborted by a weight refit" in answer.json()["error"]["message"]
    assert "retry" in answer.json()["error"]["message"]
    # The stream had begun (status 200): its last chunk says it was aborted, and by what.
    assert stream.status == 200 and last["choices"][0]["finish_reason"] == "abort"
    assert "aborted by a weight refit" in last["error"]["message"]
    assert len(stream.tokens) < LONG

    # Nothing else fails: the generator is healthy and serves the new version to new requests.
    assert abort.http.get("/healthz").status_code == 200
    again = abort.http.post("/v1/completions", json=_body(PROMPT, 8))
    assert again.status_code == 200 and again.headers["x-weight-version"] == version
    assert abort.http.get("/v1/install").json()["history"][-1]["version"] == version


def _abort_during_requests(service: Service, checkpoints) -> tuple[str, httpx.Response, Stream, dict]:
    """A refit of the abort-mode `service` while a stream and a plain request run: the version, the
    plain answer, the stream and its last chunk, of an attempt whose refit met them both running.

    Both run when the refit is asked for, but the stream is a few tokens ahead and may end before
    the pause reaches it: the tiny model makes a token in milliseconds, and on a loaded machine the
    refit's checks may take longer than the whole request (CI saw the stream end with "length" and
    the plain request aborted). Such an attempt shows nothing about abort, so another refit (of the
    other checkpoint, as a new version) tries again."""
    for attempt in range(_ATTEMPTS):
        version = f"abort-{attempt}"
        plain, stream = _refit_during_requests(service, str(checkpoints[("B", "A")[attempt % 2]]), version)
        answer, last = plain.join(), stream.join()
        if answer.status_code != 200 and last["choices"][0]["finish_reason"] != "length":
            return version, answer, stream, last
    raise AssertionError(f"no refit of {_ATTEMPTS} met both requests running (the last: {answer}, {last})")
