"""`generator_svc.vllm_adapter` against the installed vLLM, without an engine: every vLLM symbol
generator_svc uses exists, with the parameters it is called with and the attributes read off it;
the version guard names the versions; nothing else in generator_svc imports vLLM.

An upgrade of vLLM that moves or renames any of these fails here, by name, instead of making a
refit silently install wrong weights.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, get_args

import pytest

from generator_svc import vllm_adapter
from generator_svc.vllm_adapter import ATTRIBUTES, SIGNATURES, SYMBOLS

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(SYMBOLS))
def test_the_symbol_exists_in_the_installed_vllm(name: str) -> None:
    module, attribute = SYMBOLS[name]
    assert getattr(vllm_adapter, name) is not None, f"{module}.{attribute}"


def _resolve(dotted: str) -> Any:
    head, *rest = dotted.split(".")
    obj = getattr(vllm_adapter, head)
    for part in rest:
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_the_function_takes_the_parameters_it_is_called_with(name: str) -> None:
    parameters = list(inspect.signature(_resolve(name)).parameters)
    assert parameters[: len(SIGNATURES[name])] == list(SIGNATURES[name]), parameters


def _has_attribute(cls: type, attribute: str) -> bool:
    """A method, property or class attribute; a dataclass field or annotation; or an attribute
    that some `__init__`-like method in the class's vLLM bases assigns (`self.NAME = ...`)."""
    if hasattr(cls, attribute):
        return True
    if dataclasses.is_dataclass(cls) and attribute in {f.name for f in dataclasses.fields(cls)}:
        return True
    for base in cls.__mro__:
        if not base.__module__.startswith("vllm"):
            continue
        if attribute in getattr(base, "__annotations__", {}):
            return True
        tree = ast.parse(inspect.getsource(base).lstrip())
        for node in ast.walk(tree):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                    and target.attr == attribute
                ):
                    return True
    return False


@pytest.mark.parametrize(
    "cls_name,attribute",
    [(cls, attr) for cls, attrs in sorted(ATTRIBUTES.items()) for attr in attrs],
)
def test_the_class_has_the_attribute_generator_svc_reads(cls_name: str, attribute: str) -> None:
    assert _has_attribute(getattr(vllm_adapter, cls_name), attribute)


def test_the_attribute_check_can_fail() -> None:
    assert not _has_attribute(vllm_adapter.LinearBase, "no_such_attribute")
    assert _has_attribute(vllm_adapter.LinearBase, "tp_size")


def test_the_installed_vllm_is_a_supported_version() -> None:
    assert vllm_adapter.check_version(env={}).startswith(vllm_adapter.SUPPORTED_VERSIONS)


def test_another_vllm_version_fails_loudly_unless_overridden() -> None:
    with pytest.raises(vllm_adapter.VllmVersionError, match=r"vLLM 0\.33\.1 is installed.*vLLM 0\.32\.x"):
        vllm_adapter.check_version("0.33.1", env={})
    with pytest.raises(vllm_adapter.VllmVersionError, match="GENERATOR_VLLM_ANY_VERSION=1"):
        vllm_adapter.check_version("0.31.9", env={})
    assert vllm_adapter.check_version("0.33.1", env={"GENERATOR_VLLM_ANY_VERSION": "1"}) == "0.33.1"


def test_the_cpu_moe_fix_patches_once_keeping_the_signature() -> None:
    method = vllm_adapter.UnquantizedFusedMoEMethod
    before = list(inspect.signature(method._setup_kernel).parameters)
    assert vllm_adapter.apply_cpu_moe_fix() is True  # this machine runs vLLM on CPU
    patched = method._setup_kernel
    assert vllm_adapter.apply_cpu_moe_fix() is True and method._setup_kernel is patched
    assert list(inspect.signature(patched).parameters) == before


AMX_PROBE = """
import ctypes, json, torch
from generator_svc import vllm_adapter

def permitted():  # arch_prctl(ARCH_GET_XCOMP_PERM): bit 18 is XTILEDATA, AMX's tiles
    mask = ctypes.c_ulong(0)
    assert ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(mask)) == 0
    return bool(mask.value & (1 << 18))

before = permitted()
granted = vllm_adapter.request_cpu_amx_tiles()
print(json.dumps([torch.cpu._is_amx_tile_supported(), before, granted, permitted()]))
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="AMX is x86's")
def test_a_worker_may_use_amx_tiles_where_the_cpu_has_them() -> None:
    """vLLM's CPU attention uses AMX tiles without asking Linux for them (a worker whose first
    request reaches attention first dies of SIGILL); the worker extension asks at import. In a
    fresh process, where nothing asked yet."""
    out = subprocess.run([sys.executable, "-c", AMX_PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    has_amx, before, granted, after = json.loads(out.stdout.strip().splitlines()[-1])
    assert not before
    assert granted is after is has_amx


def test_no_other_generator_svc_module_imports_vllm() -> None:
    offenders = []
    for path in sorted((REPO / "generator_svc").rglob("*.py")):
        if path.name == "vllm_adapter.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            where = path.relative_to(REPO)
            offenders += [f"{where}: {n}" for n in names if n == "vllm" or n.startswith("vllm.")]
    assert offenders == []


def test_the_pause_modes_are_vllms() -> None:
    from generator_svc.settings import PauseMode
    from generator_svc.vllm_adapter import PauseMode as VllmPauseMode

    assert sorted(m.value for m in PauseMode) == sorted(get_args(VllmPauseMode))


def test_readers_of_vllms_queues_spin_as_long_as_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """What forked engines get (generator_svc.server.engine_start): a reader of vLLM's shared-memory
    queues spins `READER_SPIN_S` after a message, not vLLM's second; a writer does not spin."""
    import zmq

    from generator_svc.server.engine_start import READER_SPIN_S, readers_spin_for
    from generator_svc.vllm_adapter import SpinCondition

    monkeypatch.setattr(SpinCondition, "__init__", SpinCondition.__init__)  # put back afterwards
    readers_spin_for(READER_SPIN_S)
    context = zmq.Context()
    address = f"inproc://spin-{id(context)}"
    try:
        writer = SpinCondition(False, context, address)
        reader = SpinCondition(True, context, address)
        assert (reader.busy_loop_s, writer.busy_loop_s) == (READER_SPIN_S, 0)
        assert SpinCondition(True, context, address, busy_loop_s=3.0).busy_loop_s == 3.0
    finally:
        context.destroy(linger=0)
