"""Builds a tiny MoE + MTP engine and checks the directory, the graphs and `--check` (good and tampered)."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

from builder import cli
from models.checkpoint import load_model
from models.engine_format import SCHEMA_VERSION, EngineDirError, Limits, Parallel, load_engine_config
from tests.builder.engine_edits import copy_engine, edit_config

GRAPHS = ("main", "mtp_draft", "mtp_commit")


def _ops(path: Path) -> set[tuple[str, str]]:
    return {(n.domain, n.op_type) for n in onnx.load(str(path), load_external_data=False).graph.node}


def test_layout_and_config(engine, checkpoint):
    cfg = load_engine_config(engine)
    assert cfg.schema_version == SCHEMA_VERSION and cfg.backend == "onnxruntime" and cfg.dtype == "float32"
    assert cfg.limits == Limits(max_batch=4, max_num_tokens=32, max_seq_len=64)
    # Table width covers max_seq_len plus the 2K lookahead: ceil((64 + 4) / 4) = 17 blocks, not 64 / 4 = 16.
    assert cfg.kv.block_size == 4 and cfg.kv.num_planes == 3 and cfg.kv.table_width == 17
    assert cfg.kv.num_blocks == 4 * 17 + 1
    assert cfg.num_draft_tokens == 2 and cfg.parallel == Parallel(world_size=1, ep_size=1, tp_size=1)
    assert cfg.plugins["namespace"] == "mtp" and set(cfg.plugins["nodes"]) == {
        "KvWrite",
        "PagedAttention",
        "SwaPagedAttention",  # MiMo-V2-Flash's sliding-window attention with sinks: installed, not in this engine
        "MoeExperts",
        "MlaKvWrite",
        "MlaPagedAttention",
        "GdnStep",  # hybrid models' Gated DeltaNet op: installed, not in this GQA engine's graphs
        "DsaIndexTopk",  # DeepSeek Sparse Attention's two ops (GLM-5 / DeepSeek-V3.2): installed, not in this engine
        "DsaSparseAttention",
        "AllReduce",  # the TP collectives are installed plugins too (an engine built with tp_size 1 emits none)
        "AllGather",
    }
    assert cfg.kv.kv_kind == 0  # a GQA model: K/V pool
    assert cfg.tokenizer_files == ["tokenizer.json"] and (engine / "tokenizer.json").is_file()
    assert cfg.build["ort_session_options"]["graph_optimization_level"] == "ORT_ENABLE_EXTENDED"
    for g in GRAPHS:
        for kind in ("onnx", "data", "ort_optimized"):
            assert cfg.graph_file(0, g, kind).is_file(), (g, kind)
    assert cfg.model.n_routed_experts == 4 and len(cfg.checkpoint["sha256"]) == 64
    assert not list(engine.parent.glob(".engine.tmp-*")), "temporary build directory left behind"


@pytest.mark.parametrize("graph", GRAPHS)
def test_graphs_pass_full_onnx_check(engine, graph):
    onnx.checker.check_model(str(engine / "rank0" / f"{graph}.onnx"), full_check=True)


def test_graph_io_contract(engine):
    m = onnx.load(str(engine / "rank0" / "main.onnx"), load_external_data=False)
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in m.graph.input}
    assert dims == {"input_ids": ["tokens"], "positions": ["tokens"], "q_counts": ["requests"],
                    "kv_lens": ["requests"], "block_tables": ["requests", "max_blocks"], "logit_rows": ["logit_rows"],
                    "kv_pool_ptr": [1]}  # fmt: skip
    assert [o.name for o in m.graph.output] == ["hidden", "logits"]


def test_commit_graph_holds_only_the_kv_write(engine):
    commit = _ops(engine / "rank0" / "mtp_commit.onnx")
    assert ("mtp", "KvWrite") in commit
    assert ("mtp", "MoeExperts") not in commit and ("mtp", "PagedAttention") not in commit
    assert {("mtp", "KvWrite"), ("mtp", "PagedAttention"), ("mtp", "MoeExperts")} <= _ops(
        engine / "rank0" / "main.onnx"
    )


def test_check_cli_passes(engine, capsys):
    assert cli.main(["--check", str(engine)]) == 0
    assert "ok" in capsys.readouterr().out


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "tamper, message",
    [
        (lambda p: _flip_byte(p / "rank0" / "mtp_draft.onnx.data"), "rank0/mtp_draft.onnx.data in .* is corrupted"),
        (lambda p: (p / "rank0" / "main.ort.onnx").unlink(), "rank0/main.ort.onnx is missing"),
        (lambda p: edit_config(p, schema_version=SCHEMA_VERSION + 1), f"schema_version {SCHEMA_VERSION + 1}; this installation reads"),
        (lambda p: edit_config(p, parallel__world_size=2), "rank count mismatch.*world_size=2"),
        (lambda p: edit_config(p, plugins__nodes__KvWrite="0"), "plugin version mismatch.*KvWrite version '0'"),
        (lambda p: edit_config(p, plugins__nodes__FutureNode="1"), "plugin FutureNode version '1'.*provides version None"),
        (lambda p: (p / "config.json").unlink(), "not an engine directory"),
        (lambda p: edit_config(p, reseal=False, kv__block_size=2), "config.json in .* is corrupted"),
        (lambda p: (p / "manifest.json").unlink(), "no readable manifest.json"),
    ],
    ids=["flipped-byte", "missing-file", "schema-version", "rank-count", "plugin-version", "unknown-plugin", "no-config",
         "edited-config", "no-manifest"],
)
def test_check_refuses_tampered_engine(engine, tmp_path, capsys, tamper, message):
    copy = copy_engine(engine, tmp_path)
    tamper(copy)
    with pytest.raises(EngineDirError, match=message):
        load_engine_config(copy)
    assert cli.main(["--check", str(copy)]) == 2
    assert "check failed" in capsys.readouterr().err


def test_engine_from_before_newer_plugins_still_loads(engine, tmp_path):
    """An engine records the plugins installed when it was built; plugins added since (the MLA and collective
    nodes, for engines built before them) cannot be in its graphs, so they do not make it stale."""
    copy = copy_engine(engine, tmp_path)
    raw = json.loads((copy / "config.json").read_text())
    nodes = {k: v for k, v in raw["plugins"]["nodes"].items() if k in ("KvWrite", "PagedAttention", "MoeExperts")}
    edit_config(copy, plugins__nodes=nodes)
    assert load_engine_config(copy).plugins["nodes"] == nodes


def test_tp1_engine_has_no_collectives(engine):
    cfg = load_engine_config(engine)
    for graph in cfg.graphs[0]:
        ops = {op for _, op in _ops(cfg.graph_file(0, graph))}
        assert not ops & {"AllReduce", "AllGather"}, graph


def test_bfloat16_export_for_tensorrt_is_strongly_typed(checkpoint, tmp_path):
    """The tensorrt backend's input: typed weights and casts in the graph, float32 hidden/logits at the edges."""
    import torch

    from builder.export import export_graph
    from plugins.kv_pool import KVPoolGeometry

    model, _ = load_model(checkpoint, torch.bfloat16)
    path = tmp_path / "main.onnx"
    export_graph("main", model, KVPoolGeometry(3, 65, 4, 2, 8, 2), 16, path)
    onnx.checker.check_model(str(path), full_check=True)
    m = onnx.load(str(path))
    assert {o.type.tensor_type.elem_type for o in m.graph.output} == {onnx.TensorProto.FLOAT}
    assert any(i.data_type == onnx.TensorProto.BFLOAT16 for i in m.graph.initializer)
    kv_write = next(n for n in m.graph.node if n.op_type == "KvWrite")
    assert {a.name: a.i for a in kv_write.attribute if a.name == "dtype"} == {"dtype": 2}
