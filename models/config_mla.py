"""The MLA fields of config.json (DeepSeek-V3 / R1, GLM-4.7-Flash, and the DSA models built on MLA): read
(`mla_fields`, for ModelConfig.from_hf_dict) and written back (`mla_hf_fields`, for exported checkpoints)."""

from __future__ import annotations

from typing import Any

from models.config_dsa import DSA_MODEL_TYPES, dsa_hf_fields
from models.config_fields import ConfigError
from models.config_fields import Fields as _Fields

MLA_MODEL_TYPES = ("deepseek_v3", "glm4_moe_lite", *DSA_MODEL_TYPES)


def mla_fields(model_type: str, f: _Fields, rf: _Fields, rope_type: str) -> dict[str, Any]:
    """The MLA and rope-scaling fields of an MLA config.json ({} for GQA models, which have neither)."""
    if model_type not in MLA_MODEL_TYPES:
        if rope_type != "default":
            raise ConfigError(f"rope scaling {rope_type!r} is supported for MLA models only "
                              f"({', '.join(MLA_MODEL_TYPES)}); {model_type} takes rope_type 'default'")  # fmt: skip
        return {}
    # DeepSeek's own config keys for the router; only the sigmoid + correction-bias (noaux_tc) router is implemented
    for key, ok in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if f.raw.get(key) not in (None, ok):
            raise ConfigError(f"{key}={f.raw[key]!r} is not supported (only {ok!r}, as in DeepSeek-V3); fix config.json")
    out: dict[str, Any] = {
        "q_lora_rank": f.integer("q_lora_rank", 0, minimum=0),  # null = plain q_proj
        "kv_lora_rank": f.integer("kv_lora_rank"),
        "qk_nope_head_dim": f.integer("qk_nope_head_dim"),
        "qk_rope_head_dim": f.integer("qk_rope_head_dim"),
        "v_head_dim": f.integer("v_head_dim"),
        "rope_interleave": f.flag("rope_interleave", True),  # the HF default for both model types
        "rope_type": rope_type,
    }
    if rope_type == "yarn":
        if rf.raw.get("factor") is None:
            raise ConfigError("yarn rope scaling needs rope_parameters.factor (the context extension factor); "
                              "add it to config.json")  # fmt: skip
        out.update(
            rope_factor=rf.number("factor", 1.0),
            original_max_position_embeddings=rf.integer("original_max_position_embeddings",
                                                        f.integer("max_position_embeddings", 4096)),  # fmt: skip
            beta_fast=rf.number("beta_fast", 32.0),
            beta_slow=rf.number("beta_slow", 1.0),
            rope_mscale=rf.number("mscale", 0.0, allow_zero=True),  # 0 = absent, as in HF
            rope_mscale_all_dim=rf.number("mscale_all_dim", 0.0, allow_zero=True),
            rope_attention_factor=rf.number("attention_factor", 0.0),
            rope_truncate=rf.flag("truncate", True),
        )
    return out


def mla_hf_fields(cfg: Any) -> dict[str, Any]:
    """The config.json fields of an MLA ModelConfig that differ from GLM-4.5's (inverse of `mla_fields`)."""
    rope: dict[str, Any] = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_type == "yarn":
        rope.update(factor=cfg.rope_factor, original_max_position_embeddings=cfg.original_max_position_embeddings,
                    beta_fast=cfg.beta_fast, beta_slow=cfg.beta_slow, mscale=cfg.rope_mscale,
                    mscale_all_dim=cfg.rope_mscale_all_dim, truncate=cfg.rope_truncate)  # fmt: skip
        if cfg.rope_attention_factor:
            rope["attention_factor"] = cfg.rope_attention_factor
    arch = {"deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe_lite": "Glm4MoeLiteForCausalLM"}.get(cfg.model_type, "")
    out: dict[str, Any] = {
        "architectures": [arch], "model_type": cfg.model_type, "rope_parameters": rope,
        "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim, "rope_interleave": cfg.rope_interleave,
    }  # fmt: skip
    out.update(dsa_hf_fields(cfg))  # DeepSeek-V3.2 / GLM-5: the architecture and the indexer fields
    if cfg.model_type in ("glm4_moe_lite", *DSA_MODEL_TYPES):  # HF reads the dense/MoE split from this list only
        k = cfg.first_k_dense_replace if cfg.has_moe else cfg.num_hidden_layers
        out["mlp_layer_types"] = ["dense"] * k + ["sparse"] * (cfg.num_hidden_layers - k)
    return out
