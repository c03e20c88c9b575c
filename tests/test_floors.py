"""The floors of the code base (docs/ARCHITECTURE.md §2), read from the source: which room may import which,
no import cycles, no production module over 400 lines, a torch-free control plane, nothing outside the
engine assigning to an engine's attributes, and nothing outside runtime/core reading the engine's request table. Each check is also run against a planted violation, so it can fail.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("plugins", "models", "builder", "runtime")
APPS = ("runtime.api", "runtime.cli", "runtime.serving", "runtime.bench", "runtime.demo")  # api: the Python API
BELOW_APPS = {"plugins", "models", "models.engine_format", "runtime", "runtime.executors.base", "runtime.executors",
              "runtime.core", "runtime.multirank", "runtime.factory"}  # fmt: skip
# room -> the rooms it may import (its own room is always allowed). Lowest first.
ALLOWED: dict[str, set[str]] = {
    "plugins": set(),  # kernels, torch ops, export rules, the rank mapping: imports no project package
    "models": {"plugins"},
    "models.engine_format": {"models", "plugins"},  # the engine directory contract (builder writes, runtime reads)
    "models.training": {"models", "plugins"},
    "builder": {"models", "models.engine_format", "plugins"},
    "runtime": {"runtime.api"},  # runtime/__init__.py: the Python API's names, re-exported lazily from runtime/api.py
    "runtime.executors.base": set(),  # the executor contract: numpy dataclasses
    "runtime.core": {"runtime", "runtime.executors.base", "models", "models.engine_format"},
    "runtime.executors": {"runtime", "runtime.executors.base", "models", "models.engine_format", "plugins"},
    # models.engine_format: the start-up agreement asks whether the engine has compiled packages (one CPU ISA)
    "runtime.multirank": {"runtime", "runtime.core", "runtime.executors.base", "models", "models.engine_format",
                          "plugins"},  # fmt: skip
    "runtime.factory": {"runtime", "runtime.core", "runtime.executors", "runtime.executors.base",
                        "runtime.multirank", "models", "models.engine_format", "plugins"},  # fmt: skip
    # applications: anything below, and the builder (to make an engine); not each other (the demo runs mtp-run)
    **{app: BELOW_APPS | {"builder", "models.training"} for app in APPS},
}
ALLOWED["runtime.demo"] = ALLOWED["runtime.demo"] | {"runtime.cli"}
ALLOWED["runtime.bench"] = ALLOWED["runtime.bench"] | {"runtime.serving"}  # `mtp-bench serve` measures the servers
ROOMS = sorted(ALLOWED, key=len, reverse=True)  # longest prefix first
MAX_LINES = 400
# The control plane: what plans and schedules. It must run without torch (docs/ARCHITECTURE.md §2).
TORCH_FREE = ("runtime.core", "runtime.multirank", "runtime.factory", "runtime.executors.base", "models.config",
              "models.engine_format.config", "models.engine_format.layout", "plugins.mapping")  # fmt: skip


def room_of(module: str) -> str:
    return next(r for r in ROOMS if module == r or module.startswith(r + "."))


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> project modules it imports, lazy (function-level) imports included: a lazy import is a
    dependency all the same."""
    mods = modules(root)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = defaultdict(set)
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package
                    for _ in range(node.level - 1):
                        parent = parent.rpartition(".")[0]
                    base = f"{parent}.{base}" if base else parent
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                found = resolve(target)
                if found and found != mod:
                    graph[mod].add(found)
    return graph


def upward_imports(root: Path) -> list[str]:
    bad = []
    for mod, deps in sorted(import_graph(root).items()):
        here = room_of(mod)
        for dep in sorted(deps):
            there = room_of(dep)
            if there != here and there not in ALLOWED[here]:
                bad.append(f"{mod} imports {dep} ({here} may import only {sorted(ALLOWED[here]) or 'nothing'})")
    return bad


def cycles(root: Path) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    graph = import_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(modules(root)):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def engine_assignments(root: Path) -> list[str]:
    """`<...>engine.<attr> = ...` (or setattr(engine, ...)) anywhere but in the engine's own module."""
    bad = []
    own = root / "runtime" / "core" / "engine.py"
    for path in sorted([*root.glob("*/**/*.py")]):
        if path == own or path.parts[len(root.parts)] not in (*PACKAGES, "tests"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
                targets = [ast.Attribute(value=node.args[0], attr="?")] if node.args else []
            for t in targets:
                for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if isinstance(el, ast.Attribute) and _names_engine(el.value):
                        bad.append(f"{path.relative_to(root)}:{node.lineno} assigns {ast.unparse(el)}")
    return bad


def _names_engine(expr: ast.expr) -> bool:
    return (isinstance(expr, ast.Name) and expr.id == "engine") or (
        isinstance(expr, ast.Attribute) and expr.attr == "engine")  # fmt: skip


def engine_request_reads(root: Path) -> list[str]:
    """Production code outside runtime/core reading an engine's request table (`engine.requests`,
    `self.engine.requests`, `getattr(engine, "requests")`, or any `<x>.requests[...]`): the table holds the
    engine's live Request objects, which only the engine may touch; outside code asks the engine's public methods
    (e.g. `awaiting_first_token`, `abort`). Tests are white-box and may read it."""
    bad = []
    core = root / "runtime" / "core"
    for path in sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")):
        if path.is_relative_to(core):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            hit = (isinstance(node, ast.Attribute) and node.attr == "requests" and _names_engine(node.value)) or (
                isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
                and node.value.attr == "requests") or (
                isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "requests")
            if hit:
                bad.append(f"{path.relative_to(root)}:{node.lineno} reads {ast.unparse(node)}")  # type: ignore[attr-defined]
    return bad


def long_modules(root: Path) -> list[str]:
    return [f"{p.relative_to(root)}: {n} lines" for p in modules(root).values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES]  # fmt: skip


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> Path:
    """A copy of the source packages with one violation of each kind planted."""
    root = tmp_path_factory.mktemp("planted")
    for pkg in (*PACKAGES, "tests"):
        shutil.copytree(ROOT / pkg, root / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so", "tiny", "deep"))
    with (root / "plugins" / "rope.py").open("a") as f:  # upward: plugins -> runtime, and a cycle
        f.write("\nimport runtime.core.engine  # planted\n")
    with (root / "plugins" / "kv_pool.py").open("a") as f:
        f.write("\nfrom models import layers  # planted: models.layers imports plugins.kv_pool\n")
    with (root / "runtime" / "factory.py").open("a") as f:
        f.write("\n\ndef planted(engine):\n    engine.executor = None\n")
    with (root / "runtime" / "bench" / "runners.py").open("a") as f:  # what runners.py `_drive` did before issue 27
        f.write("\n\ndef planted(engine, ids):\n    mine = [engine.requests[i] for i in ids]\n"
                "    for i in ids:\n        engine.requests.pop(i, None)\n    return mine\n")
    with (root / "runtime" / "serving" / "stats.py").open("a") as f:
        f.write("\n\ndef planted(loop, rid):\n    return loop.engine.requests.get(rid), loop.table.requests[rid]\n")
    (root / "models" / "too_long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    return root


def test_no_upward_import():
    assert upward_imports(ROOT) == []


def test_no_import_cycle():
    assert cycles(ROOT) == []


def test_no_production_module_over_400_lines():
    assert long_modules(ROOT) == []


def test_nothing_outside_the_engine_assigns_to_it():
    assert engine_assignments(ROOT) == []


def test_nothing_outside_the_engine_reads_its_request_table():
    assert engine_request_reads(ROOT) == []


def test_each_check_finds_its_planted_violation(planted):
    assert any(b.startswith("plugins.rope imports runtime.core.engine") for b in upward_imports(planted))
    assert any({"plugins.kv_pool", "models.layers"} <= set(c) for c in cycles(planted))
    assert any("runtime/factory.py" in b and "engine.executor" in b for b in engine_assignments(planted))
    assert any("too_long.py" in b for b in long_modules(planted))
    reads = [b for b in engine_request_reads(planted) if b.startswith(("runtime/bench/runners.py", "runtime/serving"))]
    assert {b.split(" reads ")[1] for b in reads} == {"engine.requests", "engine.requests[i]", "loop.engine.requests",
                                                      "loop.table.requests[rid]"}  # fmt: skip
    assert len({b.split(" reads ")[0] for b in reads}) == 3  # both lines of runners.py, the line of stats.py


def test_control_plane_imports_no_torch():
    """In a fresh interpreter: importing every control-plane module loads neither torch nor onnx."""
    names = sorted(m for m in modules(ROOT) if any(m == p or m.startswith(p + ".") for p in TORCH_FREE))
    code = ("import sys\n" + "".join(f"import {m}\n" for m in names)
            + "print(','.join(m for m in ('torch', 'onnx', 'onnxruntime', 'mpi4py') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"the control plane imported {out.stdout.strip()}"
    assert len(names) > 15  # the list really covers the control plane
