"""A trainer attached with `syncd.member.attach` waits for what its generators serve, and is told
what happened when they do not.

A real syncd (in this process) with `--auto-refit`, the README's trainer snippet run as written on
a small model of plain tensors (rank 0, no process group), and one generator worker that moves
real bytes over gloo (`testkit.endpoints.GeneratorEndpoint`, joined through `syncd.member.join`
as vLLM's workers are), whose install the tests slow down or fail. No vLLM here: the README test
with vLLM is tests/e2e/test_readme_snippets_e2e.py.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from syncd.daemon.service import Daemon
from syncd.layout import Canon, CanonicalTensor, Catalog, local_tensor
from syncd.member import join
from syncd.member.attach import RefitFailed, attach
from syncd.states import RefitState
from syncd.vocabulary import Role
from syncd.weight_version import Version
from testkit.endpoints import GeneratorEndpoint
from tests.polling import wait_until
from tests.readme_snippets import trainer_snippet
from tests.syncd_settings import syncd_settings

VOCAB, HIDDEN = 32, 8
CANONICAL = (
    CanonicalTensor("model.embed_tokens.weight", (VOCAB, HIDDEN), "float32"),
    CanonicalTensor("lm_head.weight", (VOCAB, HIDDEN), "float32"),
)
INSTALL_FAILURE = "install failed: the engine ran out of memory (a test's failure)"


class TinyLM(torch.nn.Module):
    """An HF-named causal LM of two plain tensors: `model(**batch).loss` as the README's loop wants."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(VOCAB, HIDDEN)
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> types.SimpleNamespace:
        logits = self.lm_head(self.model.embed_tokens(input_ids))
        return types.SimpleNamespace(loss=torch.nn.functional.cross_entropy(logits, labels))


def batches(steps: int, before_each: Callable[[int], None] = lambda step: None) -> Iterator[dict]:
    """The README loop's `data`; `before_each(k)` runs when the loop asks for batch k (1-based),
    that is after step k - 1 returned."""
    for k in range(1, steps + 1):
        before_each(k)
        yield {"input_ids": torch.arange(4) + k, "labels": torch.arange(4)}


class Generator(GeneratorEndpoint):
    """One generator worker of the whole model; `install` runs in its commit, where vLLM's
    install would, before it confirms the commit to syncd."""

    def __init__(self, install: Callable[[], None] = lambda: None) -> None:
        tensors = tuple(local_tensor(c.name, c.dtype, Canon(c.name, c.shape)) for c in CANONICAL)
        super().__init__(Catalog(CANONICAL, tensors))
        self.install = install

    def commit(self, refit_id, version, timeout_s):
        self.install()
        super().commit(refit_id, version, timeout_s)


@pytest.fixture
def start(tmp_path: Path):
    """`start(generator=..., auto_refit=...)`: a syncd for one trainer rank and one generator,
    and the generator joined to it unless None; returns syncd's gRPC address."""
    started: list = []

    def run(generator: Generator | None, auto_refit: bool = True) -> str:
        settings = syncd_settings(tmp_path, expected_trainers=1, expected_generators=1, auto_refit=auto_refit)
        daemon = Daemon(settings)
        daemon.start()
        started.append(daemon)
        target = f"127.0.0.1:{daemon.grpc_port}"
        if generator is not None:
            member = join(
                target,
                generator,
                role=Role.GENERATOR,
                member_id="generator-0-0",
                coords={"replica": 0, "tp": 0},
                catalog=generator.catalog,
            )
            assert member.client.wait_registered(30)
            started.append(member)
        return target

    yield run
    for thing in reversed(started):
        thing.close() if not isinstance(thing, Daemon) else thing.stop()


def run_trainer_snippet(
    target: str, steps: int, before_each: Callable[[int], None] = lambda s: None, scope: dict | None = None
) -> dict:
    """The README's trainer snippet, run as written against `target`, in `scope` (its globals,
    returned; the caller's own to read after a step raised)."""
    model = TinyLM()
    scope = {} if scope is None else scope
    scope.update(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=batches(steps, before_each)
    )
    try:
        exec(trainer_snippet(target), scope)
    finally:
        if "handle" in scope:
            scope["handle"].close()  # the snippet's own close did not run when a step raised
    return scope


def test_each_step_of_the_readme_trainer_returns_once_the_generator_serves_it(start) -> None:
    """`wait_s`: optimizer.step() returns only after the generator installed the step, even when
    the install takes a while after syncd's commit decision (when the trainer hears its Commit)."""
    generator = Generator(install=_slow_install)
    target = start(generator)
    served_before_step: dict[int, int] = {}
    scope = run_trainer_snippet(target, 2, lambda k: served_before_step.setdefault(k, generator.version))
    assert served_before_step == {1: 0, 2: 1}, "a step returned before the generator served it"
    assert generator.version == 2
    handle = scope["handle"]
    assert handle.version == Version("2", 2)
    last = handle.last_refit
    assert (last.version, last.state, last.reason, last.served) == (
        Version("2", 2),
        RefitState.COMMITTED,
        "",
        True,
    )
    assert last.bytes == sum(4 * VOCAB * HIDDEN for _ in CANONICAL)


def _slow_install() -> None:
    time.sleep(0.5)  # an install that ends well after syncd's commit decision, as vLLM's does


def _fail_install() -> None:
    raise RuntimeError(INSTALL_FAILURE)


def test_the_readme_trainer_hears_that_a_generator_failed_its_install(start) -> None:
    """The generator's install fails after syncd decided to commit: the step raises RefitFailed
    naming the refit, its recorded state, the generator and its reason; last_refit says the same."""
    target = start(Generator(install=_fail_install))
    scope: dict = {}
    with pytest.raises(RefitFailed) as failed:
        run_trainer_snippet(target, 2, scope=scope)
    e = failed.value
    assert (e.refit_id, e.state, e.member, e.version) == (
        "refit-1",
        RefitState.COMMITTED,
        "generator-0-0",
        Version("1", 1),
    )
    assert INSTALL_FAILURE in e.reason and INSTALL_FAILURE in str(e) and "generator-0-0" in str(e)
    assert e.outcome is not None and e.outcome.unconfirmed == ("generator-0-0",)
    last = scope["handle"].last_refit  # the handle has left syncd: what it heard last
    assert (last.id, last.state, last.reason, last.unconfirmed) == (
        e.refit_id,
        e.state,
        e.reason,
        ("generator-0-0",),
    )


class LandsCorrupt(Generator):
    """A worker whose check of what landed fails: syncd aborts the refit before any commit."""

    def verify(self, refit_id):
        raise ValueError("what landed differs from what was sent (a test's failure)")


def test_an_aborted_refit_raises_refit_failed_naming_the_member_syncd_recorded(start) -> None:
    target = start(LandsCorrupt())
    with pytest.raises(RefitFailed, match="version 1 was not refitted: refit-1 ABORTED") as failed:
        run_trainer_snippet(target, 1)
    e = failed.value
    assert (e.refit_id, e.state, e.member) == ("refit-1", RefitState.ABORTED, "generator-0-0")
    assert "what landed differs from what was sent" in e.reason


@pytest.mark.parametrize(
    ("auto_refit", "with_generator", "why"),
    [
        (False, True, "syncd runs without --auto-refit"),
        (True, False, "not ready to refit: 0 of 1 generators registered"),
    ],
    ids=["no-auto-refit", "no-generator"],
)
def test_a_step_whose_refit_never_starts_says_why(start, auto_refit, with_generator, why) -> None:
    target = start(Generator() if with_generator else None, auto_refit=auto_refit)
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = attach(model, syncd=target, optimizer=optimizer, wait_s=1)
    try:
        model(**next(batches(1))).loss.backward()
        with pytest.raises(RefitFailed, match=f"no refit of version 1 started within 1 s: .*{why}") as failed:
            optimizer.step()
        assert (failed.value.refit_id, failed.value.state) == ("", None)
        assert handle.version == Version("1", 1) and handle.last_refit is None
    finally:
        handle.close()


def test_without_wait_s_steps_go_on_and_last_refit_tells_what_happened(start) -> None:
    target = start(Generator(install=_fail_install))
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = attach(model, syncd=target, optimizer=optimizer, wait_s=None)
    try:
        model(**next(batches(1))).loss.backward()
        assert optimizer.step() is None  # no wait: whatever the refit does
        last = wait_until(
            lambda: (r := handle.last_refit) is not None and r.ended and r, 60, "the refit to end"
        )
        assert (last.id, last.state, last.unconfirmed) == (
            "refit-1",
            RefitState.COMMITTED,
            ("generator-0-0",),
        )
        assert INSTALL_FAILURE in last.reason and not last.served
        with pytest.raises(RefitFailed, match="generator-0-0 did not confirm it"):
            handle.wait_refit(1, timeout_s=60)  # a wait after the fact hears the same
    finally:
        handle.close()
