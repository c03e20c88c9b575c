"""MLA (DeepSeek-V3, GLM-4.7-Flash) config parsing, RoPE parameters and checkpoint import / export checks.

The parity tests live in tests/models/test_mla_parity.py; this file reuses its mla_checkpoints and helpers.
"""

from __future__ import annotations

import pytest
import torch

from models.checkpoint import CheckpointError, load_model, read_model_config
from models.checkpoint_export import to_hf_tensors
from models.config import ConfigError, ModelConfig
from models.mla import kv_geometry_fields
from models.testing import YARN, tiny_config
from plugins.rope import rope_parameters, yarn_softmax_scale
from tests.models.test_mla_parity import ids_for, load_hf, paged_logits

transformers = pytest.importorskip("transformers")


def test_rope_parameters_and_mscale_match_hf():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    for params in (YARN, {**YARN, "mscale": 0.707, "factor": 40.0, "original_max_position_embeddings": 8},
                   {**YARN, "truncate": False, "beta_fast": 16}, {**YARN, "attention_factor": 1.3}):  # fmt: skip
        hf_cfg = transformers.DeepseekV3Config(hidden_size=32, num_attention_heads=4, qk_rope_head_dim=8,
                                               max_position_embeddings=512, rope_parameters=dict(params))  # fmt: skip
        inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
        ours = rope_parameters(8, params["rope_theta"], "yarn", params["factor"], params["original_max_position_embeddings"],
                               params["beta_fast"], params["beta_slow"], params["mscale"], params["mscale_all_dim"],
                               params.get("attention_factor", 0.0), params.get("truncate", True))  # fmt: skip
        assert torch.equal(ours[0], inv_freq) and ours[1] == factor
        assert yarn_softmax_scale(18, "yarn", params["factor"], params["mscale_all_dim"]) == yarn_apply_mscale(
            params, 18**-0.5)


def test_mla_config_parsed_and_round_trips(mla_checkpoints):
    cfg, _ = read_model_config(mla_checkpoints("dsv3_yarn"))
    assert cfg.is_mla and cfg.rope_type == "yarn" and cfg.q_lora_rank == 24 and cfg.head_dim == 8
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert kv_geometry_fields(cfg) == (1, 8 + 16, 1)
    lite, hf = read_model_config(mla_checkpoints("glm_lite"))
    assert lite.q_lora_rank == 0 and lite.first_k_dense_replace == 1 and hf["mlp_layer_types"] == ["dense", "sparse"]


def test_gqa_config_dict_unchanged():
    """A GLM-4.5 engine's config.json model section keeps exactly its pre-MLA keys."""
    d = tiny_config().to_dict()
    assert not {"kv_lora_rank", "rope_type", "q_lora_rank", "rope_interleave"} & set(d)
    assert ModelConfig.from_dict(d) == tiny_config() and not tiny_config().is_mla
    assert kv_geometry_fields(tiny_config()) == (2, 8, 0)


def base_hf():
    return {"model_type": "deepseek_v3", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 10,
            "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 0}  # fmt: skip


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "rope scaling type 'longrope' is not supported; supported: default, yarn"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "yarn rope scaling needs rope_parameters.factor"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim=7 is odd"),
    ({"kv_lora_rank": None}, "missing required field kv_lora_rank"),
    ({"v_head_dim": 0}, "v_head_dim must be an integer >= 1"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2 must equal num_attention_heads=4"),
    ({"model_type": "glm4_moe_lite", "mlp_layer_types": ["sparse", "dense"]}, "interleaves dense and sparse"),
    ({"model_type": "glm4_moe", "rope_parameters": {"rope_type": "yarn", "factor": 2.0}, "kv_lora_rank": None},
     "supported for MLA models only"),
])  # fmt: skip
def test_bad_mla_configs_get_one_line_errors(change, message):
    hf = {k: v for k, v in {**base_hf(), **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        ModelConfig.from_hf_dict(hf)
    assert "\n" not in str(e.value)


def test_export_restores_the_checkpoint_tensors(mla_checkpoints):
    """to_hf_tensors (the exporter) re-interleaves the rope rows: every imported tensor comes back bit for bit."""
    from safetensors.torch import load_file

    path = mla_checkpoints("dsv3")
    original = load_file(str(path / "model.safetensors"))
    exported = to_hf_tensors(load_model(path)[0])
    kept = {k: v for k, v in original.items() if not k.endswith(("2.embed_tokens.weight", "2.shared_head.head.weight"))}
    assert set(exported) == set(kept)
    for name, t in kept.items():
        assert torch.equal(exported[name], t), name


def test_missing_mla_tensor_is_named(mla_checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    path = mla_checkpoints("glm_lite")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.kv_b_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"missing tensors \['layers.1.self_attn.kv_b_proj.weight'\]"):
        load_model(tmp_path)


@pytest.mark.parametrize("model_type, overrides", [
    ("deepseek_v3", dict(rope_type="yarn", rope_factor=4.0, original_max_position_embeddings=128, rope_mscale=1.0,
                         rope_mscale_all_dim=0.8)),
    ("glm4_moe_lite", dict(q_lora_rank=0, n_group=1, topk_group=1)),
])  # fmt: skip
def test_our_exporter_writes_mla_checkpoints_transformers_loads(tmp_path, model_type, overrides):
    """make_checkpoint (our exporter: to_hf_config + rope rows re-interleaved) -> transformers -> same logits."""
    from models.testing import make_checkpoint, tiny_mla_config

    cfg = tiny_mla_config(model_type, **overrides)
    ours = make_checkpoint(tmp_path, cfg, seed=11)
    assert read_model_config(tmp_path)[0] == cfg
    ids = ids_for(cfg)
    with torch.no_grad():
        torch.testing.assert_close(paged_logits(ours, ids, prefill=10), load_hf(tmp_path)(ids[None]).logits[0],
                                   atol=1e-4, rtol=1e-4)  # fmt: skip


DEEPSEEK_V3_CONFIG = {  # the released deepseek-ai/DeepSeek-V3 config.json, minus auto_map and quantization_config
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0,
    "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "model_type": "deepseek_v3", "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
    "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128,
    "vocab_size": 129280,
}  # fmt: skip


def test_released_deepseek_v3_config_parses():
    """Legacy rope_scaling with "type", no rope_interleave key (HF's default: interleaved), the latent pool row."""
    cfg = ModelConfig.from_hf_dict(DEEPSEEK_V3_CONFIG)
    assert (cfg.rope_type, cfg.rope_factor, cfg.original_max_position_embeddings) == ("yarn", 40.0, 4096)
    assert cfg.rope_interleave and cfg.q_lora_rank == 1536 and cfg.first_k_dense_replace == 3
    heads, latent, kind = kv_geometry_fields(cfg)
    assert (heads, latent, kind) == (1, 576, 1)
    # per token and layer: 576 latent values vs K and V per head decompressed, 128 x (192 + 128)
    assert 128 * (128 + 64 + 128) / latent > 70
    hf = transformers.DeepseekV3Config(**DEEPSEEK_V3_CONFIG)
    inv_freq, factor = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["yarn"](hf)
    ours = rope_parameters(64, 10000.0, "yarn", 40.0, 4096, 32, 1, 1.0, 1.0)
    assert torch.equal(ours[0], inv_freq) and ours[1] == factor
    for key, bad in (("scoring_func", "softmax"), ("topk_method", "greedy")):
        with pytest.raises(ConfigError, match=f"{key}='{bad}' is not supported"):
            ModelConfig.from_hf_dict({**DEEPSEEK_V3_CONFIG, key: bad})
