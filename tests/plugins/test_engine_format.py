"""The engine-format package: one contract for builder and runtime, with no import of one by the other."""

from __future__ import annotations

import ast
from dataclasses import MISSING, fields
from pathlib import Path

import numpy as np
import pytest

from builder.options import BuildOptions
from models.checkpoint import CheckpointError, read_checkpoint, read_model_config
from models.engine_format.graph_io import GRAPH_NAMES, SPECS, feeds
from models.engine_format.layout import table_width
from models.testing import make_checkpoint, tiny_config
from runtime.core.config import RuntimeConfig
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
                 if m.startswith(("runtime.executors", "models.engine_format", "runtime.factory", "runtime.core.config"))}  # fmt: skip
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
    required = [f.name for f in fields(step_cls) if f.default is MISSING]  # the arrays a step feeds the graph
    assert tuple(required) == spec.step_inputs
    # fields with a default are run-time choices the executor reads (DraftInput.depth: which MTP module drafts)
    assert not {f.name for f in fields(step_cls) if f.default is not MISSING} & set(spec.inputs)
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


def _pool_node(op_type: str, **attrs: int):
    from onnx import helper

    return helper.make_node(op_type, [], [], domain="mtp", **attrs)


def test_pool_node_attributes_must_match_config_kv_gqa_and_mla():
    """MLA nodes call head_dim latent_dim and imply kv_kind 1; a mismatch names the attribute and the kv field."""
    from models.engine_format.crosscheck import node_mismatch
    from models.engine_format.layout import KVLayout

    moe = {"num_experts": 4, "ep_size": 1}
    gqa = KVLayout(4, 9, 3, 2, 8, 0, 5)
    mla = KVLayout(4, 9, 3, 1, 72, 2, 5, kv_kind=1)
    gqa_attrs = dict(plane=1, num_planes=3, num_blocks=9, block_size=4, num_kv_heads=2, head_dim=8, dtype=0)
    mla_attrs = dict(plane=2, **mla.geometry().attrs())
    assert mla_attrs == dict(plane=2, num_planes=3, num_blocks=9, block_size=4, latent_dim=72, dtype=2)
    for op in ("KvWrite", "PagedAttention"):
        assert node_mismatch(gqa, moe, _pool_node(op, **gqa_attrs)) is None
        assert "in an engine whose config.json gives an MLA latent pool (kv.kv_kind=1)" in str(
            node_mismatch(mla, moe, _pool_node(op, **gqa_attrs)))  # fmt: skip
    for op in ("MlaKvWrite", "MlaPagedAttention"):
        assert node_mismatch(mla, moe, _pool_node(op, **mla_attrs, rope_dim=8)) is None
        assert node_mismatch(mla, moe, _pool_node(op, **{**mla_attrs, "latent_dim": 64})) == (
            f"{op} node was built with latent_dim=64 but config.json gives kv.head_dim=72")
        assert node_mismatch(mla, moe, _pool_node(op, **{**mla_attrs, "dtype": 0})) == (
            f"{op} node was built with dtype=0 but config.json gives kv.dtype_code=2")
        assert node_mismatch(mla, moe, _pool_node(op, **{**mla_attrs, "plane": 3})) == (
            f"{op} node writes plane 3 outside the pool")
        assert "gives a GQA K/V pool (kv.kv_kind=0)" in str(node_mismatch(gqa, moe, _pool_node(op, **mla_attrs)))
    assert node_mismatch(gqa, moe, _pool_node("MoeExperts", num_experts=4, ep_size=2)) == (
        "MoeExperts node was built with ep_size=2 but config.json gives ep_size=1")


def test_config_kv_kind_round_trip_and_default():
    """kv.kv_kind is written by every new build; a config.json from before it existed means 0 (GQA)."""
    from dataclasses import asdict

    from models.engine_format.config import _ints
    from models.engine_format.crosscheck import _pool_rows
    from models.engine_format.layout import KVLayout

    mla = KVLayout(4, 9, 3, 1, 72, 2, 5, kv_kind=1)
    assert asdict(mla)["kv_kind"] == 1 and _ints(KVLayout, asdict(mla), "kv") == mla
    old = {k: v for k, v in asdict(KVLayout(4, 9, 3, 2, 8, 0, 5)).items() if k != "kv_kind"}
    assert _ints(KVLayout, old, "kv").kv_kind == 0
    with pytest.raises(KeyError, match="kv.table_width"):
        _ints(KVLayout, {k: v for k, v in old.items() if k != "table_width"}, "kv")
    with pytest.raises(TypeError, match="kv.kv_kind"):
        _ints(KVLayout, {**old, "kv_kind": "1"}, "kv")
    assert _pool_rows(tiny_config()) == {"kv_kind": 0, "num_kv_heads": tiny_config().num_key_value_heads,
                                         "head_dim": tiny_config().head_dim}  # fmt: skip
    from models.testing import tiny_mla_config

    deepseek = tiny_mla_config(kv_lora_rank=512, qk_rope_head_dim=64, head_dim=64)  # DeepSeek-V3: 64 + 512
    assert _pool_rows(deepseek) == {"kv_kind": 1, "num_kv_heads": 1, "head_dim": 576}
