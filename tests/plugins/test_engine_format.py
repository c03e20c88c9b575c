"""The engine-format package: one contract for builder and runtime, with no import of one by the other."""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

from builder.options import BuildOptions
from models.checkpoint import CheckpointError, read_checkpoint, read_model_config
from models.testing import make_checkpoint, tiny_config
from plugins.engine_format.graph_io import GRAPH_NAMES, SPECS, feeds
from plugins.engine_format.layout import table_width
from runtime.config import RuntimeConfig
from runtime.executors import base

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("builder", "plugins", "runtime", "models")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, top_level_only: bool) -> set[str]:
    """Project modules `path` imports (each with its parent packages, which Python executes first)."""
    tree = ast.parse(path.read_text())
    nodes: list[ast.AST] = []

    def collect(body: list[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
                continue  # never executed
            if isinstance(stmt, ast.Import | ast.ImportFrom):
                nodes.append(stmt)
            elif isinstance(stmt, ast.If | ast.Try):
                for block in ("body", "orelse", "finalbody"):
                    collect(getattr(stmt, block, []))
                for handler in getattr(stmt, "handlers", []):
                    collect(handler.body)

    if top_level_only:
        collect(tree.body)
    else:
        nodes = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)  # `from pkg import submodule`
    out = set()
    for name in names:
        parts = name.split(".")
        if parts[0] in PACKAGES:
            out.update(".".join(parts[: i + 1]) for i in range(len(parts)))
    return out


def _graph(top_level_only: bool) -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    modules = {_module_name(p): p for p in files}
    return {m: {d for d in _imports(p, top_level_only) if d in modules and d != m} for m, p in modules.items()}


def test_no_executor_imports_the_builder():
    graph = _graph(top_level_only=False)  # lazy (function-level) imports count too
    offenders = {m: sorted(d for d in deps if d.split(".")[0] == "builder") for m, deps in graph.items()
                 if m.startswith(("runtime.executors", "plugins.engine_format", "runtime.factory", "runtime.config"))}  # fmt: skip
    assert not {m: d for m, d in offenders.items() if d}, offenders
    fmt = {m: sorted(d for d in deps if d.split(".")[0] == "runtime") for m, deps in graph.items()
           if m.startswith("plugins.")}  # fmt: skip
    assert not {m: d for m, d in fmt.items() if d}, "plugins/ must not depend on the runtime"


def test_no_import_cycles_between_project_modules():
    graph = _graph(top_level_only=True)
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycle = stack[stack.index(d) :] + [d]
                # A package importing its own submodules (re-exports in __init__) is not a cycle to forbid.
                if not all(c.startswith(cycle[0] + ".") or c == cycle[0] for c in cycle):
                    pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


@pytest.mark.parametrize(
    "graph, step_cls, out_cls",
    [("main", base.MainInput, base.MainOutput), ("mtp_draft", base.DraftInput, base.DraftOutput),
     ("mtp_commit", base.CommitInput, None)],
)  # fmt: skip
def test_executor_dataclasses_are_named_as_the_graph_io(graph, step_cls, out_cls):
    spec = SPECS[graph]
    assert tuple(f.name for f in fields(step_cls)) == spec.step_inputs
    if out_cls is not None:
        assert tuple(f.name for f in fields(out_cls)) == spec.outputs
    assert set(spec.dtypes) == set(spec.inputs) | set(spec.outputs) and set(GRAPH_NAMES) == set(SPECS)


def test_feeds_cast_every_input_to_the_contract_dtype():
    inp = base.MainInput(input_ids=[1, 2], positions=[0, 1], q_counts=[2], kv_lens=[2],
                         block_tables=[[1, -1]], logit_rows=[1])  # fmt: skip
    got = feeds(SPECS["main"], inp)
    assert list(got) == list(SPECS["main"].step_inputs)
    assert {n: a.dtype for n, a in got.items()} == {n: np.dtype(SPECS["main"].dtypes[n]) for n in got}


def test_one_table_width_for_builder_and_runtime():
    cfg = tiny_config()
    for L, k, B in [(512, 2, 16), (64, 2, 4), (64, 0, 4), (63, 3, 8)]:
        layout = BuildOptions(Path("c"), Path("o"), max_seq_len=L, num_draft_tokens=k, kv_block_size=B,
                              max_num_tokens=64).kv_layout(cfg)  # fmt: skip
        runtime = RuntimeConfig(max_seq_len=L, num_draft_tokens=k, block_size=B, max_num_tokens=64)
        assert layout.table_width == runtime.max_blocks_per_request == table_width(L, k, B) == -(-(L + 2 * k) // B)
    assert table_width(512, 2, 16) == 33  # the default options: 33 columns, not ceil(512/16) = 32


def test_model_config_is_read_without_any_tensor(tmp_path):
    ckpt = tmp_path / "ckpt"
    make_checkpoint(ckpt, tiny_config(), seed=1)
    (ckpt / "model.safetensors").write_bytes(b"not a safetensors file")  # any tensor read would fail
    cfg, hf = read_model_config(ckpt)
    assert cfg == tiny_config() and hf["model_type"] == "glm4_moe"
    with pytest.raises(Exception):  # noqa: B017 (whatever safetensors raises: the point is that it reads)
        read_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match="has no config.json"):
        read_model_config(tmp_path)
