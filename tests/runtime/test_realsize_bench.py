"""The realistic-size bench's pure parts (runtime/bench/realsize.py, realsize_ckpt.py): the checkpoint's shapes and
size, the bytes a decode token reads, the MTP projection's arithmetic. The bench itself is run by `make
bench-realsize` (1.6 GB, minutes), never here, and nothing here is timed."""

from __future__ import annotations

import json

import pytest

from models.checkpoint_hybrid import model_class
from runtime.bench.bound import forward_params
from runtime.bench.realsize import deep_acceptance, project_mtp, weight_bytes_per_token
from runtime.bench.realsize_ckpt import AIR_CUTS, realsize_config


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
