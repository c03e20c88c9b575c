"""The realistic-size bench's pure parts (runtime/bench/realsize.py, realsize_ckpt.py, realsize_plan.py,
realsize_report.py): the checkpoint's shapes and size, the bytes a decode token reads in each format, the MTP
projection's arithmetic (at the bench's depth and at GLM-4.5-Air's 46 layers), the table and the plot. The bench itself is run by `make
bench-realsize` (1.6 GB, minutes), never here, and nothing here is timed."""

from __future__ import annotations

import json

import pytest

from models.checkpoint_hybrid import model_class
from runtime.bench.bound import forward_params
from runtime.bench.realsize import deep_acceptance, project_mtp, weight_bytes_per_token
from runtime.bench.realsize_ckpt import AIR_CUTS, realsize_config
from runtime.bench.realsize_plan import (
    FORMATS,
    WEIGHT_KINDS,
    at_depth,
    compiled_bytes,
    dir_bytes,
    format_by_name,
    gguf_bytes_per_token,
    main_bytes,
    main_params_by_kind,
    mtp_at_bench_depth,
    project_depth,
)
from runtime.bench.realsize_report import BEGIN, END, markdown, write_outputs


def test_config_has_glm45_air_layer_shapes_and_fits_1_to_2_gb():
    c = realsize_config()
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4096, 96, 8, 128)
    assert (c.intermediate_size, c.moe_intermediate_size, c.n_shared_experts) == (10944, 1408, 1)
    for field, (_air, ours) in AIR_CUTS.items():
        assert getattr(c, field) == ours
    import torch

    with torch.device("meta"):
        model = model_class(c)(c)
    params = sum(p.numel() for p in model.parameters())
    assert 1e9 <= 2 * params <= 2e9  # bf16 bytes


def test_weight_bytes_split_adds_up_to_the_bound_module_count():
    c = realsize_config()
    wb = weight_bytes_per_token(c, 2.0)
    parts = wb["attention_proj"] + wb["routed_experts"] + wb["dense_mlp_shared_router"] + wb["lm_head"]
    assert wb["main"] == pytest.approx(2 * forward_params(c, 1).main)
    # the parts leave out only norms, biases, the router bias and one embedding row: well under 1%
    assert 0 < wb["main"] - parts < 0.01 * wb["main"]
    assert weight_bytes_per_token(c, 4.0)["main"] == pytest.approx(2 * wb["main"])


def test_project_mtp_arithmetic():
    ms = {"decode": 10.0, "verify_2": 12.0, "draft": 3.0, "commit_2": 1.0, "verify_3": 14.0, "commit_3": 1.5}
    out = project_mtp(ms, {1: 1.8, 2: 2.4})
    assert out["0"]["tokens_per_second"] == pytest.approx(100.0)
    assert out["1"]["step_ms"] == pytest.approx(12.0 + 3.0 + 1.0)
    assert out["1"]["tokens_per_second"] == pytest.approx(1.8 * 1e3 / 16.0, rel=1e-3)
    assert out["2"]["step_ms"] == pytest.approx(14.0 + 2 * 3.0 + 1.5)
    assert out["2"]["x_k0"] == pytest.approx(2.4 * 10.0 / 21.5, rel=1e-3)
    assert out["2"]["x_k0_mtp_free"] == pytest.approx(2.4 * 10.0 / 14.0, rel=1e-3)
    assert "3" not in project_mtp(ms, {3: 3.0})  # no verify_4 measured: no projection invented


def test_deep_acceptance_reads_batch_1(tmp_path):
    bench = {"tokens_per_second": {"torch": {"1": {"1": {"mean_acceptance_length": 1.9}},
                                             "8": {"1": {"mean_acceptance_length": 1.5}}},
                                   "compiled": {"1": {"2": {"mean_acceptance_length": 2.4}}}}}  # fmt: skip
    p = tmp_path / "bench.json"
    p.write_text(json.dumps(bench))
    assert deep_acceptance(p, [1, 2, 3]) == {1: 1.9, 2: 2.4}


# --- the format bench (runtime/bench/realsize_plan.py, realsize_report.py) ---------------------------------------


@pytest.mark.parametrize("tokens", [1, 4])
def test_main_params_by_kind_add_up_to_the_bound(tokens):
    c = realsize_config()
    kinds = main_params_by_kind(c, tokens)
    assert set(kinds) == set(WEIGHT_KINDS)
    assert sum(kinds.values()) == pytest.approx(forward_params(c, tokens).main)
    assert main_bytes(c, tokens, format_by_name("bf16")) == pytest.approx(2 * forward_params(c, tokens).main)


def test_format_bytes_follow_what_each_format_stores():
    c = realsize_config()
    kinds = main_params_by_kind(c, 1)
    b = {f.name: main_bytes(c, 1, f) for f in FORMATS}
    keep_bf16 = 2 * (kinds["router"] + kinds["lm_head"] + kinds["other"])
    quantized = kinds["attention"] + kinds["dense_mlp"]
    assert b["fp8"] == pytest.approx(keep_bf16 + (1 + 4 / 128**2) * (quantized + kinds["routed_experts"]))
    # int4: dense linears and routed experts at Q4_0's bytes (4 bits + an fp32 scale per 64)
    assert b["int4"] == pytest.approx(keep_bf16 + 0.5625 * (quantized + kinds["routed_experts"]))
    assert b["int4"] < b["int8"] < b["bf16"]
    with pytest.raises(ValueError, match="unknown format 'nf4'"):
        format_by_name("nf4")


def test_project_depth_scales_main_forwards_by_bytes_and_keeps_the_mtp_layer():
    c = realsize_config()
    f = format_by_name("int8")
    ms = {"decode": 50.0, "verify_2": 55.0, "draft": 20.0, "commit_2": 4.0}
    at_bench = project_depth(ms, c, f, {1: 1.9}, depth=c.num_hidden_layers)
    assert at_bench["1"]["x_k0"] == mtp_at_bench_depth(ms, {1: 1.9})["1"] == pytest.approx(1.9 * 50 / 79, abs=1e-3)
    deep = project_depth(ms, c, f, {1: 1.9})
    r1, r2 = (main_bytes(at_depth(c, 46), n, f) / main_bytes(c, n, f) for n in (1, 2))
    assert deep["0"]["step_ms"] == pytest.approx(50 * r1, abs=1e-3)
    assert deep["1"]["step_ms"] == pytest.approx(55 * r2 + 20 + 4, abs=1e-3)
    assert deep["1"]["x_k0"] == pytest.approx(1.9 * 50 * r1 / (55 * r2 + 24), abs=1e-3)
    assert deep["1"]["x_k0"] > at_bench["1"]["x_k0"]  # the one MTP layer weighs less against 46 main layers
    assert "2" not in project_depth(ms, c, f, {2: 2.4})  # verify_3 not measured: nothing invented


def test_gguf_bytes_per_token_reads_main_blocks_topk_experts_and_one_embedding_row():
    tensors = [("token_embd.weight", 2048 * 64, 2048 * 64 * 2), ("output_norm.weight", 64, 256),
               ("output.weight", 2048 * 64, 1000), ("blk.0.attn_q.weight", 0, 300),
               ("blk.1.ffn_up_exps.weight", 0, 800), ("blk.1.ffn_up_shexp.weight", 0, 40),
               ("blk.2.attn_q.weight", 0, 300), ("blk.2.ffn_up_exps.weight", 0, 800)]  # fmt: skip
    got = gguf_bytes_per_token(tensors, main_layers=2, top_k=4, n_experts=8, hidden=64)
    assert got == pytest.approx(64 * 2 + 256 + 1000 + 300 + 800 * 4 / 8 + 40)


def _result(tmp_path):
    c = realsize_config()
    accept = {1: 1.9, 2: 2.4}
    ms = {"decode": 60.0, "verify_2": 64.0, "verify_3": 70.0, "draft": 30.0, "commit_2": 5.0, "commit_3": 6.0}
    row = {"label": "bf16 weights", "decode_ms": 60.0, "bound_ms": 55.0, "over_bound": 1.091, "llama_quant": "BF16",
           "llama_ms": 80.0, "llama_bound_ms": 56.0, "over_llama": 0.75, "engine_bytes": 5.3e9, "engine_aoti_bytes": 1.7e9,
           "gguf_bytes": 1.6e9, "rss_after_load_bytes": 1.9e9,
           "peak_rss_bytes": 2.1e9, "llama_peak_rss_bytes": 1.7e9, "steps_ms": ms,
           "mtp_x_k0_bench_depth": mtp_at_bench_depth(ms, accept),
           "mtp_projection_depth_46": project_depth(ms, c, format_by_name("bf16"), accept)}  # fmt: skip
    phase = {"threads": 1, "bandwidth_gb_s_best": 16.0, "load_average_after": [3.0], "formats": {"bf16": row},
             "llama_only": {"BF16": {"ms": 80.0, "bound_ms": 56.0}, "Q4_K_M": {"ms": 31.5, "bound_ms": 12.25}}}  # fmt: skip
    return {"timestamp": "T", "command": "python -m runtime.bench.realsize_formats", "projection_label": "PROJECTION x",
            "machine": {"cpu": "cpu", "cores": 2, "load_average_start": [2.5, 2, 2]},
            "settings": {"context": 32, "rounds": 5, "iters": 3, "llama_tokens": 16, "ks": [1, 2]},
            "mtp_acceptance_from_deep_model": {"length": accept}, "phases": [phase]}  # fmt: skip


def test_report_table_rows_and_projection_label(tmp_path):
    res = _result(tmp_path)
    text = markdown(res)
    row = next(line for line in text.splitlines() if line.startswith("| bf16: bf16 weights"))
    cells = [x.strip() for x in row.split("|")[1:-1]]
    assert cells[1:5] == ["60.0", "55.0", "1.09x", "BF16"] and cells[8] == "0.75x" and cells[7] == "1.43x"
    assert cells[9:12] == ["1.70 GB (5.30 GB)", "1.60 GB", "2.10 GB (1.90 GB)"]
    assert "Q4_K_M 31.5 ms (its bound 12.2 ms)" in text and "PROJECTION x" in text and "other work inflates" in text
    assert "--no-repack" not in text
    res["phases"][0]["llama_flags"] = {"Q4_K_M": ["--no-repack"]}  # its defaults crashed (an AMX CPU): said under the table
    assert "llama.cpp ran Q4_K_M with `--no-repack`" in markdown(res)
    steps = next(line for line in text.splitlines() if line.startswith("| bf16 | 60.0"))
    deep = res["phases"][0]["formats"]["bf16"]["mtp_projection_depth_46"]
    best = min(v["step_ms"] / v.get("tokens_per_step", 1.0) for v in deep.values())
    llama_46 = 80.0 * deep["0"]["step_ms"] / 60.0  # llama.cpp's 80 ms scaled by our bytes ratio at depth 46
    assert steps.rstrip(" |").endswith(f"{deep['2']['x_k0']:.2f}x | {llama_46 / best:.2f}x")


def test_report_splices_between_markers_and_plots(tmp_path):
    docs = tmp_path / "BENCHMARKS.md"
    docs.write_text(f"head\n{BEGIN}\nold\n{END}\ntail\n")
    write_outputs(_result(tmp_path), docs, tmp_path / "realsize.png")
    text = docs.read_text()
    assert text.startswith("head\n") and text.endswith("tail\n") and "old" not in text and "| bf16: bf16" in text
    assert (tmp_path / "realsize.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    docs.write_text("no markers\n")
    with pytest.raises(ValueError, match="no <!-- realsize-table:begin"):
        write_outputs(_result(tmp_path), docs, tmp_path / "realsize.png")


def test_dir_bytes_counts_the_compiled_packages_apart(tmp_path):
    (tmp_path / "rank0").mkdir()
    (tmp_path / "rank0" / "main.aoti.pt2").write_bytes(b"x" * 7)
    (tmp_path / "rank0" / "main.onnx.data").write_bytes(b"x" * 11)
    (tmp_path / "config.json").write_bytes(b"x" * 2)
    assert dir_bytes(tmp_path) == 20 and dir_bytes(tmp_path, "*.aoti.pt2") == 7
    (tmp_path / "rank0" / "mtp_draft.aoti_fused.pt2").write_bytes(b"x" * 3)
    (tmp_path / "rank0" / "weights.safetensors").write_bytes(b"x" * 100)  # the packages' weights: loaded too
    assert compiled_bytes(tmp_path) == 110
    assert dir_bytes(tmp_path / "config.json") == 2
