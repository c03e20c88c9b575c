"""Shared pytest set-up: deterministic, single-threaded torch (2-core machines), repo-root imports, and the test
tiers: the one place that marks every test that launches mpirun, a server, an AOTInductor compile or an engine
build (`make test-quick` deselects them; README "Tests")."""

import functools
import gc
import inspect
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Ranks waiting in an MPI collective yield the core instead of busy-polling it (Open MPI's default when a host
# is not oversubscribed): the suite runs mpirun jobs beside another pytest worker on 2 cores, where a spinning
# rank takes the time the rank it waits for (or the other worker) needs. Measured under load ~8: a 4-rank TP test
# 29-57 s -> 19-41 s wall at the same CPU time; on a quiet machine no change (docs/PERFORMANCE.md "Threads and
# runtime defaults"). Every mpirun a test starts inherits it (Open MPI reads OMPI_MCA_* from the environment and
# forwards them to its daemons' ranks).
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
# The AOTInductor packages the suite builds (~40 graph compiles in `make test`) compile their wrapper (the
# generated C++ that calls the kernels in order: glue, no arithmetic) at -O0 instead of Inductor's -O1. The kernels
# stay -O3 and the package is otherwise byte-for-byte what a user's build makes, so every test still runs the real
# compiled graphs. Measured on the 2-core machine (g++ CPU per wrapper, 4 samples each, load ~4): 5.2-5.5 s at -O1,
# 3.8-4.1 s at -O0, i.e. ~1.4 CPU-s per graph compile. Read by torch._inductor.config at import (set before any
# test imports it) and inherited by the spawned rank children of multi-rank builds and by mpirun.
os.environ.setdefault("AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL", "O0")


@pytest.fixture(autouse=True, scope="session")
def _torch_setup():
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    yield


TINY = ROOT / "models" / "tiny"
# The flags of the shared multi-rank engines of models/tiny: K=3 so the runtime tests can run K = 0..3.
TINY_TP_BUILD_FLAGS = ("--num-draft-tokens", "3", "--max-seq-len", "128", "--max-batch", "4")


@pytest.fixture(scope="session")
def tiny_dp2tp2_ep4_engine(tmp_path_factory) -> Path:
    """`mtp-build` of models/tiny for 4 ranks, DP2 x TP2 with EP4 (onnxruntime): four ranks' exports take minutes
    on a 2-core machine, so one build serves tests/builder/test_tp_build.py (each rank's graphs vs the torch
    model) and tests/runtime/test_mpi_tp.py (greedy generation under mpirun vs the single rank)."""
    from builder import cli

    out = tmp_path_factory.mktemp("tiny_dp2tp2_ep4") / "engine"
    argv = ["--checkpoint", str(TINY), "--output", str(out), "--compile", "none", "--world-size", "4", "--tp-size", "2", "--ep-size", "4",
            *TINY_TP_BUILD_FLAGS]  # fmt: skip
    assert cli.main(argv) == 0
    return out


@pytest.fixture(scope="session")
def tiny_tp2_build(tmp_path_factory) -> tuple[Path, str]:
    """(engine, what mtp-build printed): `mtp-build` of models/tiny for 2 ranks with --tp-size 2 and no --ep-size
    (its default, EP2), --compile aoti --keep-onnx: per rank the ONNX graphs with their weights (what onnxruntime runs)
    and the AOTInductor packages (what `auto` runs). The compiles take minutes on a 2-core machine, so one build serves
    tests/runtime/test_mpi_tp.py (both executors under mpirun), tests/builder/test_tp_build.py (each rank's shards,
    collectives and --check) and tests/builder/test_build_defaults.py (the printed EP default)."""
    import contextlib
    import io

    from builder import cli

    out = tmp_path_factory.mktemp("tiny_tp2") / "engine"
    argv = ["--checkpoint", str(TINY), "--output", str(out), "--compile", "aoti", "--keep-onnx", "--world-size", "2",
            "--tp-size", "2", *TINY_TP_BUILD_FLAGS]  # fmt: skip
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # rich's Console writes to sys.stdout as it is at print time
        rc = cli.main(argv)
    assert rc == 0, printed.getvalue()[-3000:]
    return out, printed.getvalue()


@pytest.fixture(scope="session")
def tiny_tp2_engine(tiny_tp2_build) -> Path:
    return tiny_tp2_build[0]


def run_checked(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="session")
def wheel_venv(tmp_path_factory) -> tuple[Path, Path, dict[str, str]]:
    """(venv, its site-packages, env): the wheel of a fresh `git clone` of this repository, built the documented way
    (`pip wheel --no-deps --no-build-isolation`), installed into a new virtual environment outside the repository.
    Shared by tests/test_wheel_install.py and tests/runtime/test_serve_install.py (one wheel build, minutes).

    The new environment borrows this one's packages: a `.pth` in its site-packages names this environment's
    site-packages directory. A plain directory line does not process that directory's `.pth` files, so this
    repository's editable install (an import finder that would win over any path) never runs there, and the
    repository is not importable: what runs is the wheel."""
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip(f"{ROOT} is not a git checkout (or git is missing): the wheel is built from a fresh clone of it")
    tmp = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    run_checked([git, "clone", "--quiet", str(ROOT), str(tmp / "clone")], cwd=tmp, env=env, timeout=120)
    run_checked([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir",
                 str(tmp / "wheels"), str(tmp / "clone")], cwd=tmp, env=env, timeout=600)  # fmt: skip
    (wheel,) = (tmp / "wheels").glob("mtp_engine-*.whl")
    venv = tmp / "venv"
    run_checked([sys.executable, "-m", "venv", str(venv)], cwd=tmp, env=env, timeout=120)
    py = venv / "bin" / "python"
    site = Path(run_checked([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                            cwd=tmp, env=env, timeout=60).stdout.strip())  # fmt: skip
    (site / "_mtp_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # this env's packages
    run_checked([str(py), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)], cwd=tmp, env=env,
                timeout=300)  # fmt: skip
    return venv, site, env


@pytest.fixture(scope="session")
def tiny_ep2_engine(tmp_path_factory) -> Path:
    """`mtp-build` of models/tiny for 2 ranks with expert parallelism (EP2, no TP; onnxruntime, K=2): one build
    serves tests/builder/test_build.py (each rank's graphs hold its experts) and tests/runtime/test_mpi_lockstep.py
    (mtp-run on it under mpirun)."""
    from builder import cli

    out = tmp_path_factory.mktemp("tiny_ep2") / "engine"
    argv = ["--checkpoint", str(TINY), "--output", str(out), "--compile", "none", "--world-size", "2", "--ep-size", "2",
            "--num-draft-tokens", "2", "--max-seq-len", "128", "--max-batch", "4"]  # fmt: skip
    assert cli.main(argv) == 0
    return out


# What makes a test heavy, found in its own source, the fixtures it uses (transitively) and the module-level
# helpers either calls (two levels deep): so a new test is marked without anyone remembering to.
TIERS = {
    "mpi": re.compile(r'"mpirun"|MPIRUN|mpi_launch|mpirun_path\('),
    "server": re.compile(r'"runtime\.serving\.triton_server"|"tritonserver"|TritonServer\(|"--frontend"|uvicorn\.|'
                         r"TestClient\("),
    # an mtp-build without "--compile", "none" compiles (its default is auto): the fixtures that do are named
    "compile": re.compile(r'"aoti"|compile_graph\(|compile_rank\(|aoti_compile|compiled_build'),
    # mtp-build's required flag (with --checkpoint), the Python builder, the test helpers that call it
    "build": re.compile(r'"--output", str\(|build_engine\(|\bbuild\(tiny_opts|build_main\(|"builder\.cli"'),
}
# Files whose tests cost seconds of CPU each without launching anything the tiers above find, marked `slow` here so
# `make test-quick` stays the inner loop (per-test CPU, `make test-quick` on 2026-12-04: 279 CPU-s in all, these
# 131): the MLA and MiMo-V2 lossless grids (torch executor, several model families x K x chunk), the mtp-run CLI in
# a subprocess (each pays torch's import), and the bench's smoke run. make test still runs them.
SLOW_FILES = ("tests/runtime/test_mla_lossless.py", "tests/runtime/test_mimo_v2_lossless.py",
              "tests/runtime/test_run_reliability.py", "tests/runtime/test_bench.py")  # fmt: skip
MARKERS = {
    "slow": "long-running tests (still run by make test)",
    "scale": "needs a GiB-size workload to show what it checks (make test-scale and CI, not make test)",
    "gpu": "needs a CUDA device (skipped on CPU)",
    "mpi": "launches mpirun (assigned in tests/conftest.py)",
    "server": "starts tritonserver or the OpenAI HTTP server (assigned in tests/conftest.py)",
    "compile": "builds AOTInductor packages (assigned in tests/conftest.py)",
    "build": "builds an engine with mtp-build (assigned in tests/conftest.py)",
    "triton": "runs a Triton kernel in the CPU interpreter, TRITON_INTERPRET=1 (assigned in tests/conftest.py)",
}


def pytest_configure(config):
    for name, what in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {what}")


def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _names(code: types.CodeType) -> set[str]:
    """The global names a function's code (and the code nested in it) refers to."""
    return set(code.co_names).union(*(_names(c) for c in code.co_consts if isinstance(c, types.CodeType)))


@functools.cache  # ~1100 tests share a few hundred fixtures and helpers: read each once
def _reached_source(func, depth: int = 3) -> str:
    """func's source and that of the test-suite functions and classes it names, `depth` references deep (the
    helpers under tests/ that launch things; library code is not followed: its messages mention mpirun too)."""
    seen, todo, parts = set(), [(func, 0)], []
    while todo:
        f, d = todo.pop()
        f = inspect.unwrap(f) if callable(f) else f
        if not isinstance(f, types.FunctionType | type) or f in seen or not f.__module__.startswith("tests"):
            continue
        seen.add(f)
        parts.append(_source(f))
        if d >= depth:
            continue
        funcs = [f] if isinstance(f, types.FunctionType) else [v for v in vars(f).values() if isinstance(v, types.FunctionType)]
        for g in funcs:
            todo += [(g.__globals__[n], d + 1) for n in _names(g.__code__) if n in g.__globals__]
    return "\n".join(parts)


def tiers_of(item) -> set[str]:
    """The heavy tiers test `item` belongs to (see TIERS)."""
    text = [_reached_source(item.function)] if hasattr(item, "function") else []
    for defs in item._fixtureinfo.name2fixturedefs.values():
        text += [_reached_source(d.func) for d in defs if d.baseid is not None]
    source = "\n".join(text)
    tiers = {tier for tier, pattern in TIERS.items() if pattern.search(source)}
    if item.nodeid.split("::")[0] in SLOW_FILES:
        tiers.add("slow")
    params = getattr(item, "callspec", None)  # a kernel test's "triton" case runs under TRITON_INTERPRET (CPU: slow)
    if params is not None and any(isinstance(v, str) and v == "triton" for v in params.params.values()):
        tiers.add("triton")
    return tiers


# tryfirst: pytest-xdist's own hook turns each item's xdist_group mark into its node id's `@group` suffix (what
# --dist loadgroup schedules by), so the marks must be on the items before it runs.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        for tier in sorted(tiers_of(item) - {m.name for m in item.iter_markers()}):
            item.add_marker(tier)
    groups = xdist_groups(items)
    for item, group in groups.items():
        item.add_marker(pytest.mark.xdist_group(group))
    items[:] = costliest_groups_first(items, groups)


def pytest_collection_finish(session):
    """Collection imported every test module (torch, transformers, onnx...): hundreds of thousands of long-lived
    objects that every full collection of the run would scan again. Freezing them leaves each gen-2 collection only
    what the tests themselves create (gc.freeze is for exactly this: a large, stable heap made before the work)."""
    gc.collect()
    gc.freeze()


# A test's rough cost by tier, in seconds on the 2-core machine: the scale of the measured means (an mpirun test
# 10-30 s, a compiled build minutes, a unit test well under 1 s), used only to order the groups.
TIER_COST = {"compile": 60.0, "mpi": 20.0, "build": 15.0, "slow": 15.0, "server": 5.0, "triton": 5.0}


def costliest_groups_first(items, groups: dict) -> list:
    """The items reordered group by group, the costliest group first (each group's items keep their order). The
    Makefile runs pytest-xdist with --no-loadscope-reorder, so its workers take the groups in this order: the long
    ones start at once instead of ending the run alone (its own order is by test count, which put a one-test
    multi-minute file last)."""
    cost: dict[str, float] = {}
    for item in items:
        marks = {m.name for m in item.iter_markers()}
        cost[groups[item]] = cost.get(groups[item], 0.0) + max([0.5] + [c for t, c in TIER_COST.items() if t in marks])
    order = {g: i for i, g in enumerate(sorted(cost, key=lambda g: -cost[g]))}
    return sorted(items, key=lambda item: order[groups[item]])  # stable: a group's own order stays


SHARED_BUILD = re.compile(TIERS["build"].pattern + r'|"wheel"')  # session fixtures worth building once


def xdist_groups(items) -> dict:
    """item -> the pytest-xdist worker group it runs in (`make test` runs `-n 2 --dist loadgroup`): a file's tests
    stay together (its module fixtures are built once), files that share an expensive session fixture (an engine
    build) join one group (built once, not once per worker), and every mpirun test is in one group: two
    `mpirun -np 4` jobs at once on 2 cores would only slow each other and crowd the collective watchdogs."""
    parent = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    def union(a, b):
        parent[find(a)] = find(b)

    for item in items:
        file = item.nodeid.split("::")[0]
        find(file)
        if item.get_closest_marker("mpi"):
            union(file, "mpi")
        for name, defs in item._fixtureinfo.name2fixturedefs.items():
            if any(d.scope == "session" and SHARED_BUILD.search(_reached_source(d.func)) for d in defs):
                union(file, f"fixture:{name}")
    return {item: find(item.nodeid.split("::")[0]) for item in items}
