"""The project's modules import each other without cycles, lazy (function-level) imports included
(a cycle hidden behind a lazy import still ties two modules that should be layered), and syncd's
two programs stay apart: the member library and the services never reach the daemon, nor it them.

The graph is read from the sources (`ast`), not by importing them: an edge goes from a module to
every project module it names in an `import` or `from ... import`, at any depth. `from pkg import
name` points at `pkg.name` when that is a module, else at `pkg`. Python also runs a package's
`__init__` before any of its modules; those implicit edges are left out, since a package that
re-exports its own modules (`syncd.plan`) would otherwise form a cycle with each of them.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("syncd", "trainer_svc", "generator_svc", "deploy", "bench", "testkit")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                out.add(target if target in known else base)
    return {m for m in out if m in known and m != module}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_project_has_no_import_cycles():
    modules = _modules()
    graph = {m: _imports(m, p, set(modules)) for m, p in modules.items()}
    assert _cycles(graph) == []


def test_tests_and_benchmarks_share_fixtures_only_through_testkit():
    """The fixtures both need live in `testkit`: the tests never import a benchmark, and neither
    `testkit` nor `bench` imports the tests (lazy imports included)."""
    modules = _modules() | {_module_name(p): p for p in (REPO / "tests").rglob("*.py")}
    graph = {m: _imports(m, p, set(modules)) for m, p in modules.items()}

    def crossing(importers: tuple[str, ...], imported: tuple[str, ...]) -> dict[str, list[str]]:
        edges = {m: sorted(w for w in graph[m] if w.split(".")[0] in imported) for m in graph}
        return {m: ws for m, ws in edges.items() if ws and m.split(".")[0] in importers}

    assert crossing(("tests",), ("bench",)) == {}
    assert crossing(("testkit", "bench"), ("tests",)) == {}
    assert crossing(("testkit",), ("bench",)) == {}
    assert crossing(("tests",), ("testkit",)), "the tests import their fixtures from testkit"


def test_the_cycle_finder_finds_a_lazy_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


def test_the_member_library_and_the_services_never_import_the_daemon_nor_the_daemon_the_members():
    """`syncd.member` runs inside trainer ranks and vLLM workers; `syncd.daemon` is another program.
    Both import only the shared vocabulary (`syncd.commands`, `syncd.states`, `syncd.layout`,
    `syncd.plan`, `syncd.api`)."""
    modules = _modules()
    graph = {m: _imports(m, p, set(modules)) for m, p in modules.items()}
    members = [m for m in graph if m.startswith(("syncd.member", "trainer_svc", "generator_svc"))]
    assert members and all(
        not any(r.startswith("syncd.daemon") for r in _reachable(graph, m)) for m in members
    ), {m: sorted(r for r in _reachable(graph, m) if r.startswith("syncd.daemon")) for m in members}
    daemon = [m for m in graph if m.startswith("syncd.daemon")]
    assert daemon and all(
        not any(r.startswith("syncd.member") for r in _reachable(graph, m)) for m in daemon
    ), {m: sorted(r for r in _reachable(graph, m) if r.startswith("syncd.member")) for m in daemon}


def test_the_member_library_needs_no_http_stack_and_no_process_imports_triton_before_a_gpu_needs_it():
    """Trainer ranks and GPU workers import the member library where only torch, grpc and the
    data plane's own packages are installed (the GPU machine has no pydantic, fastapi or httpx).
    Triton's kernels load when a CUDA tensor first asks for them: a CPU trainer rank does not pay
    Triton's import (a quarter of a second, in each of the suite's 180 ranks)."""
    code = (
        "import sys, syncd.member.agent, syncd.member.client, syncd.member.dataplane.delta; "
        "print(sorted(m for m in ('pydantic', 'fastapi', 'httpx') if m in sys.modules)); "
        "import trainer_svc.__main__, syncd.member.dataplane.landed; "
        "print('triton' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.split("\n")[:2] == ["[]", "False"], out.stdout


def _names_vllm(path: Path) -> bool:
    """Whether the module imports vLLM anywhere (lazy and TYPE_CHECKING imports included)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "vllm" for a in node.names):
            return True
        if (
            isinstance(node, ast.ImportFrom)
            and not node.level
            and (node.module or "").split(".")[0] == "vllm"
        ):
            return True
    return False


def test_syncd_and_the_trainer_never_import_vllm(tmp_path: Path) -> None:
    """Only generator_svc runs inside vLLM: syncd's daemon, the member library in trainer ranks and
    the trainer run where vLLM is not installed. Checked through every project module they reach."""
    modules = _modules()
    graph = {m: _imports(m, p, set(modules)) for m, p in modules.items()}
    probe = tmp_path / "probe.py"  # the check sees a lazy vLLM import (generator_svc loads it by name)
    probe.write_text("def engine():\n    from vllm.config import VllmConfig\n")
    assert _names_vllm(probe)
    reaching = {
        m: sorted(r for r in _reachable(graph, m) | {m} if _names_vllm(modules[r]))
        for m in graph
        if m.split(".")[0] in ("syncd", "trainer_svc")
    }
    assert reaching and not any(reaching.values()), {m: v for m, v in reaching.items() if v}


def test_the_generator_api_server_and_its_workers_never_import_each_other():
    """`generator_svc.server` runs in the API-server process, `generator_svc.worker` inside vLLM's
    worker processes; they talk through `collective_rpc` and status files, with the types of
    `generator_svc.worker_protocol`. Neither reaches the other, nor `generator_svc.attach` (users'
    engines), which is the one package that uses both."""
    modules = _modules()
    graph = {m: _imports(m, p, set(modules)) for m, p in modules.items()}

    def inside(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    rules = {
        "generator_svc.server": ("generator_svc.worker", "generator_svc.attach"),
        "generator_svc.worker": ("generator_svc.server", "generator_svc.attach"),
    }
    crossings = {
        m: sorted(r for r in _reachable(graph, m) if any(inside(r, f) for f in forbidden))
        for package, forbidden in rules.items()
        for m in graph
        if inside(m, package)
    }
    assert crossings and not any(crossings.values()), {m: v for m, v in crossings.items() if v}
