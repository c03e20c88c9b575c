"""The realistic-size hybrid row's pure parts (runtime/bench/realsize_hybrid_ckpt.py, realsize_hybrid.py): the
checkpoint's published shapes, its cuts and size, its tensor names (read back by our own import rules), the bytes a
decode token reads, the prompt's length, the ratios and the table. The bench itself is run by `make
bench-realsize-hybrid` (1.4 GB, an engine build, minutes), never here, and nothing here is timed."""

from __future__ import annotations

import math
import re

import pytest
import torch

from models.checkpoint import LAYOUTS
from runtime.bench.realsize_hybrid import BEGIN, END, decode_read_bytes, prompt_text, ratios, table
from runtime.bench.realsize_hybrid_ckpt import (
    CUTS,
    PUBLISHED,
    hf_config,
    hf_name,
    model_config,
    plan_bytes,
    tensor_plan,
)
from runtime.bench.realsize_hybrid_tp import BEGIN as TP_BEGIN
from runtime.bench.realsize_hybrid_tp import END as TP_END
from runtime.bench.realsize_hybrid_tp import line, summarize
from tests.conftest import ROOT


def test_config_keeps_the_published_per_layer_shapes_and_says_what_is_cut():
    c = model_config()
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (2048, 16, 2, 256)
    assert (c.partial_rotary_factor, c.rope_theta, c.rotary_dim) == (0.25, 1e7, 64)
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
            c.linear_conv_kernel_dim) == (16, 32, 128, 128, 4)  # fmt: skip
    assert (c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size) == (8, 512, 512)
    assert c.layer_types == ("linear_attention",) * 3 + ("full_attention",)  # one period of the 3:1 pattern
    assert c.num_nextn_predict_layers == 1 and not c.tie_word_embeddings
    hf = hf_config()
    for key, cut in CUTS.items():
        assert hf[key] == cut < PUBLISHED[key]
    assert (c.n_routed_experts, c.vocab_size) == (CUTS["num_experts"], CUTS["vocab_size"])


def test_plan_is_1_to_2_gb_and_its_bytes_are_the_tensors_sizes():
    plan = tensor_plan(model_config())
    total = plan_bytes(plan)
    assert 1e9 <= total <= 2e9
    h, e, i = 2048, CUTS["num_experts"], 512
    assert plan["model.layers.0.mlp.experts.gate_up_proj"] == ((e, 2 * i, h), torch.bfloat16)
    assert plan["mtp.layers.0.mlp.experts.down_proj"] == ((e, h, i), torch.bfloat16)
    assert plan["model.layers.0.linear_attn.in_proj_qkv.weight"][0] == (2 * 16 * 128 + 32 * 128, h)
    assert plan["model.layers.3.self_attn.q_proj.weight"][0] == (2 * 16 * 256, h)  # [q ; output gate]
    assert plan["model.layers.0.linear_attn.A_log"] == ((32,), torch.float32)
    experts = sum(math.prod(s) * d.itemsize for n, (s, d) in plan.items() if ".experts." in n)
    assert experts == 5 * e * 3 * h * i * 2  # 4 main layers + the MTP layer, bf16


def test_every_tensor_name_reads_back_to_our_canonical_name():
    """hf_name inverts the import rules: the loader's first matching rule maps each written name back."""
    cfg = model_config()
    with torch.device("meta"):
        from models.checkpoint_hybrid import model_class

        names = [n for n, _ in model_class(cfg)(cfg).named_parameters()]
    rules = LAYOUTS["qwen3_5_moe_text"]
    for name in names:
        written = hf_name(name)
        rule = next(r for r in rules if re.fullmatch(r.pattern, written))
        assert re.fullmatch(rule.pattern, written).expand(rule.target) == name, written  # type: ignore[union-attr]


def test_decode_read_bytes_reads_top_k_of_the_experts_and_skips_the_mtp_layer():
    plan = tensor_plan(model_config())
    h, e, i = 2048, CUTS["num_experts"], 512
    got = decode_read_bytes(plan, 8)
    main = sum(math.prod(s) * d.itemsize for n, (s, d) in plan.items() if not n.startswith("mtp."))
    experts = 4 * e * 3 * h * i * 2
    embed = 2048 * h * 2
    assert got == pytest.approx(main - experts + experts * 8 / e - embed + h * 2)
    assert decode_read_bytes(plan, e) - got == pytest.approx(experts * (1 - 8 / e))


def test_prompt_is_2000_tokens_of_our_tokenizer():
    text, n = prompt_text(ROOT / "models" / "deep" / "tokenizer.json", 2000)
    assert abs(n - 2000) <= 2 and text.startswith("The quick brown fox")


def _result() -> dict:
    med = {"ours bf16 K=0": {"ttft": 9000.0, "decode": 40.0}, "ours int8 K=0": {"ttft": 8000.0, "decode": 30.0},
           "llama.cpp BF16": {"ttft": 18000.0, "decode": 80.0}}  # fmt: skip
    return {"timestamp": "T", "command": "cmd", "machine": {"cores": 2, "load_average_start": [3.5, 0, 0]},
            "model": {"shapes": "S", "decode_read_bytes": 4.4e8},
            "settings": {"prompt_tokens": 2000, "tokens": 32, "rounds": 3},
            "phases": [{"threads": 1, "median": med, "load_average_after": [3.25, 0, 0]}]}  # fmt: skip


def test_ratios_compare_each_engine_with_the_quant_of_the_same_format():
    r = ratios(_result()["phases"][0])
    assert r["ours bf16 K=0"] == {"decode": 0.5, "ttft": 0.5}
    assert r["ours int8 K=0"] == {"decode": None, "ttft": None}  # no Q8_0 run: no ratio, not a wrong one
    assert "llama.cpp BF16" not in r


def test_table_rows_carry_the_ratios_and_the_load():
    text = table(_result())
    assert "| 1 | ours bf16 K=0 | 9000 | 40.0 | 0.50x | 0.50x | 3.25 |" in text
    assert "| 1 | ours int8 K=0 | 8000 | 30.0 | - | - | 3.25 |" in text
    assert "| 1 | llama.cpp BF16 | 18000 | 80.0 | - | - | 3.25 |" in text
    assert "load average 3.50" in text and "0.44 GB" in text
    docs = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    assert BEGIN in docs and END in docs


def test_tp2_summary_compares_per_token_time_and_every_output():
    one = {"ms_per_token": 100.0, "step_ms": 90.0, "output_ids": [5, 6, 7]}
    tp2 = {"ms_per_token": 80.0, "step_ms": 70.0, "output_ids": [5, 6, 7]}
    res = summarize({"1 rank": [one, one], "TP2": [tp2, {**tp2, "ms_per_token": 60.0}]})
    assert res["median"]["TP2"]["ms_per_token"] == 70.0 and res["one_rank_over_tp2"] == pytest.approx(100 / 70, 1e-3)
    assert res["outputs_identical"]
    assert not summarize({"1 rank": [one], "TP2": [{**tp2, "output_ids": [5, 6, 8]}]})["outputs_identical"]
    res |= {"timestamp": "T", "load_average_start": [4.0], "load_average_end": [5.0], "threads": 1, "tokens": 48,
            "rounds": 2, "command": "cmd"}  # fmt: skip
    assert "one rank 100.0 ms/token, TP2 70.0 ms/token: one rank / TP2 = 1.43x; outputs identical: yes" in line(res)
    docs = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    assert TP_BEGIN in docs and TP_END in docs
