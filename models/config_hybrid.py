"""config.json of the hybrid Gated-DeltaNet family -> ModelConfig fields (models/config.py calls `hybrid_fields`).

`qwen3_next` (Qwen3-Next), `qwen3_5_moe_text` / `qwen3_5_text` (the Qwen3.5 / 3.6 MoE and dense text models) and
`qwen3_5_moe` / `qwen3_5` (the released multimodal checkpoints: their `text_config` is read; the vision tower is not
imported). `layer_types` (or `full_attention_interval`) decides which layers are Gated DeltaNet ("linear_attention")
and which gated full attention; every layer's FFN is the softmax-routed MoE with a sigmoid-gated shared expert (MoE
types) or a dense SwiGLU MLP (`qwen3_5_text`, `qwen3_5`). What is not implemented is refused with one line naming the
field.
"""

from __future__ import annotations

from typing import Any

from models.config_fields import ConfigError, Fields, eos_ids

LAYER_TYPES = ("linear_attention", "full_attention")
MULTIMODAL_TYPES = ("qwen3_5_moe", "qwen3_5")
DENSE_TYPES = ("qwen3_5_text", "qwen3_5")


def hybrid_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig keyword arguments of a Qwen3-Next / Qwen3.5-MoE config.json (validated field by field)."""
    model_type = hf["model_type"]
    top = hf
    if model_type in MULTIMODAL_TYPES:  # multimodal release: the language model's config is text_config
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{model_type} config.json needs a text_config object (the language model's config)")
        hf = text
    f = Fields(hf)
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
        f.integer(key)
    n_layers = f.integer("num_hidden_layers")
    types = hf.get("layer_types")
    if types is None:
        interval = f.integer("full_attention_interval", 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or any(t not in LAYER_TYPES for t in types):
        raise ConfigError(f"layer_types must list {n_layers} entries of {LAYER_TYPES}, got {types!r}; fix config.json")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"rope_parameters must be a JSON object, got {rope!r}; fix config.json")
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    if rope_type != "default":
        raise ConfigError(f"rope type {rope_type!r} is not supported for {model_type} (only 'default'; text positions "
                          "make Qwen3.5's mrope the default rope)")  # fmt: skip
    rf = Fields(rope, prefix="rope_parameters.")
    dense = model_type in DENSE_TYPES
    n_experts = 0 if dense else f.integer("num_experts", 0, minimum=0)
    if n_experts == 0 and not dense:
        raise ConfigError(f"{model_type} with num_experts=0 (a dense FFN) is not supported; dense Qwen3.5 checkpoints "
                          "are model_type qwen3_5 / qwen3_5_text")  # fmt: skip
    if f.integer("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
        raise ConfigError("decoder_sparse_step != 1 or a non-empty mlp_only_layers (dense layers among MoE) is not "
                          "supported; every layer must be MoE, as in the Qwen3-Next / Qwen3.5 releases")  # fmt: skip
    if hf.get("mtp_use_dedicated_embeddings"):
        raise ConfigError("mtp_use_dedicated_embeddings=true is not supported (the MTP module must share the main "
                          "model's embedding and lm_head)")  # fmt: skip
    heads = f.integer("num_attention_heads")
    num_mtp = f.integer("mtp_num_hidden_layers", f.integer("num_nextn_predict_layers", 0, minimum=0), minimum=0)
    if num_mtp > 1:
        raise ConfigError(f"mtp_num_hidden_layers={num_mtp} is not supported for {model_type} (the releases have 1)")
    tie = Fields(top).flag("tie_word_embeddings", f.flag("tie_word_embeddings", False))
    return dict(
        model_type=model_type,
        vocab_size=f.integer("vocab_size"),
        hidden_size=f.integer("hidden_size"),
        intermediate_size=f.integer("intermediate_size") if dense else f.integer("intermediate_size", 1),  # MoE: unused
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=f.integer("num_key_value_heads", heads),
        head_dim=f.integer("head_dim", f.integer("hidden_size") // heads),
        rms_norm_eps=f.number("rms_norm_eps", 1e-6),
        rope_theta=rf.number("rope_theta", f.number("rope_theta", 10000.0)),
        partial_rotary_factor=rf.number("partial_rotary_factor", f.number("partial_rotary_factor", 0.25)),
        attention_bias=f.flag("attention_bias", False),
        use_qk_norm=True,
        first_k_dense_replace=0,
        moe_intermediate_size=0 if dense else f.integer("moe_intermediate_size"),
        n_routed_experts=n_experts,
        num_experts_per_tok=0 if dense else f.integer("num_experts_per_tok"),
        norm_topk_prob=True if model_type != "qwen3_next" else f.flag("norm_topk_prob", True),
        num_nextn_predict_layers=num_mtp,
        tie_word_embeddings=tie,
        max_position_embeddings=f.integer("max_position_embeddings", 4096),
        eos_token_id=eos_ids(hf.get("eos_token_id", top.get("eos_token_id"))),
        layer_types=tuple(types),
        linear_conv_kernel_dim=f.integer("linear_conv_kernel_dim", 4, minimum=2),
        linear_key_head_dim=f.integer("linear_key_head_dim"),
        linear_value_head_dim=f.integer("linear_value_head_dim"),
        linear_num_key_heads=f.integer("linear_num_key_heads"),
        linear_num_value_heads=f.integer("linear_num_value_heads"),
        shared_expert_intermediate_size=f.integer("shared_expert_intermediate_size", 0, minimum=0),
    )


def validate_hybrid(cfg: Any) -> None:
    """Cross-field checks of a hybrid ModelConfig (called by ModelConfig.validate)."""
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise ConfigError(f"linear_num_value_heads={cfg.linear_num_value_heads} must be a multiple of "
                          f"linear_num_key_heads={cfg.linear_num_key_heads}; fix config.json")  # fmt: skip
    if "full_attention" not in cfg.layer_types:
        raise ConfigError("layer_types has no full_attention layer; at least one is needed (the MTP layer's kind)")
