"""config.json of MiMo-V2-Flash (`mimo_v2_flash`, transformers `MiMoV2FlashConfig`) -> ModelConfig fields.

models/config.py calls `mimo_v2_fields`. What the family adds to the GLM-4.5 fields, read as transformers reads it:
  * `layer_types`: per main layer "sliding_attention" or "full_attention" (default: full for layer 0 and every 6th);
    sliding layers have twice the KV heads (`swa_num_key_value_heads`), one sink logit per query head, their own
    rope theta (`rope_parameters.sliding_attention`), and see `sliding_window` keys, the query included
    (transformers' convention; a release's `sliding_window_size` is the keys BEFORE the query, hence + 1);
  * `head_dim` (q/k) != `v_head_dim` and values scaled by `attention_value_scale`;
  * `mlp_layer_types` dense/sparse (dense first, then the sigmoid-routed MoE without shared experts);
  * `num_nextn_predict_layers` MTP modules (3 in the releases), each a sliding-window layer with a dense MLP.
What is not implemented is refused with one line naming the field.
"""

from __future__ import annotations

from typing import Any

from models.config_fields import ConfigError, Fields, eos_ids

LAYER_KINDS = ("sliding_attention", "full_attention")


def _default_layer_types(n: int) -> list[str]:
    return ["full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]


def _rope(hf: dict[str, Any], kind: str) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) of one layer kind; transformers' defaults when rope_parameters is absent."""
    rope = hf.get("rope_parameters")
    if rope is None:
        return (5_000_000.0 if kind == "full_attention" else 10_000.0), 0.334
    if not isinstance(rope, dict) or not isinstance(rope.get(kind), dict):
        raise ConfigError(f"rope_parameters must map each layer type ({', '.join(LAYER_KINDS)}) to its rope "
                          f"parameters, got {rope!r}; fix config.json")  # fmt: skip
    params = rope[kind]
    if (params.get("rope_type") or "default") != "default":
        raise ConfigError(f"rope_parameters.{kind}.rope_type {params['rope_type']!r} is not supported (only "
                          "'default')")  # fmt: skip
    f = Fields(params, prefix=f"rope_parameters.{kind}.")
    return f.number("rope_theta", 10_000.0), f.number("partial_rotary_factor", 0.334)


def mimo_v2_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig keyword arguments of a MiMo-V2-Flash config.json (validated field by field)."""
    f = Fields(hf)
    n_layers = f.integer("num_hidden_layers")
    heads = f.integer("num_attention_heads")
    kv_heads = f.integer("num_key_value_heads", 4)
    types = hf.get("layer_types") or _default_layer_types(n_layers)
    if not isinstance(types, list) or len(types) != n_layers or any(t not in LAYER_KINDS for t in types):
        raise ConfigError(f"layer_types must list {n_layers} entries of {LAYER_KINDS}, got {types!r}; fix config.json")
    swa_kv = 2 * kv_heads  # transformers' MiMoV2FlashAttention: sliding layers double the KV heads
    if hf.get("swa_num_key_value_heads") not in (None, swa_kv):
        raise ConfigError(f"swa_num_key_value_heads={hf['swa_num_key_value_heads']} is not supported: transformers' "
                          f"MiMo-V2-Flash gives sliding layers 2 * num_key_value_heads = {swa_kv}")  # fmt: skip
    mlp = hf.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n_layers - 1)
    if not isinstance(mlp, list) or len(mlp) != n_layers or any(t not in ("dense", "sparse") for t in mlp):
        raise ConfigError(f'mlp_layer_types must list {n_layers} entries of "dense"/"sparse", got {mlp!r}')
    k = mlp.index("sparse") if "sparse" in mlp else n_layers
    if mlp != ["dense"] * k + ["sparse"] * (n_layers - k):
        raise ConfigError(f"mlp_layer_types {mlp} interleaves dense and sparse layers; only dense-then-MoE layouts "
                          "are supported (the release: 1 dense layer, then MoE)")  # fmt: skip
    full_theta, full_prf = _rope(hf, "full_attention")
    swa_theta, swa_prf = _rope(hf, "sliding_attention")
    if full_prf != swa_prf:
        raise ConfigError(f"partial_rotary_factor differs between full ({full_prf}) and sliding ({swa_prf}) layers; "
                          "one rotary width for both is supported")  # fmt: skip
    window = f.integer("sliding_window", 129)
    if hf.get("sliding_window_size") is not None:  # Xiaomi's own field: keys before the query
        window = f.integer("sliding_window_size") + 1
    n_experts = f.integer("n_routed_experts", 0, minimum=0) if k < n_layers else 0
    scale = hf.get("attention_value_scale", 0.707)
    return dict(
        model_type="mimo_v2_flash",
        vocab_size=f.integer("vocab_size"),
        hidden_size=f.integer("hidden_size"),
        intermediate_size=f.integer("intermediate_size"),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=f.integer("head_dim", 192),
        v_head_dim=f.integer("v_head_dim", 128),
        rms_norm_eps=f.number("rms_norm_eps", 1e-5),
        rope_theta=full_theta,
        partial_rotary_factor=full_prf,
        attention_bias=f.flag("attention_bias", False),
        first_k_dense_replace=k if n_experts else n_layers,
        moe_intermediate_size=f.integer("moe_intermediate_size", 0, minimum=0) if n_experts else 0,
        n_routed_experts=n_experts,
        num_experts_per_tok=f.integer("num_experts_per_tok", 0, minimum=0) if n_experts else 0,
        n_group=f.integer("n_group", 1),
        topk_group=f.integer("topk_group", 1),
        routed_scaling_factor=f.number("routed_scaling_factor", 1.0),  # the hub writes null: 1.0
        norm_topk_prob=f.flag("norm_topk_prob", True),
        n_shared_experts=0,
        num_nextn_predict_layers=f.integer("num_nextn_predict_layers", 0, minimum=0),
        tie_word_embeddings=f.flag("tie_word_embeddings", False),
        max_position_embeddings=f.integer("max_position_embeddings", 4096),
        eos_token_id=eos_ids(hf.get("eos_token_id")),
        layer_types=tuple(types),
        sliding_window=window,
        swa_num_key_value_heads=swa_kv,
        swa_rope_theta=swa_theta,
        attention_value_scale=1.0 if scale is None else Fields(hf).number("attention_value_scale", 0.707),
    )


def validate_mimo_v2(cfg: Any) -> None:
    """Cross-field checks of a MiMo-V2-Flash ModelConfig (called by ModelConfig.validate)."""
    if not 0 < cfg.v_head_dim <= cfg.head_dim:
        raise ConfigError(f"v_head_dim={cfg.v_head_dim} must be in 1..head_dim={cfg.head_dim} (values are stored "
                          "zero-padded to head_dim in the KV pool)")  # fmt: skip
    if cfg.num_attention_heads % cfg.swa_num_key_value_heads:
        raise ConfigError(f"num_attention_heads={cfg.num_attention_heads} is not a multiple of the sliding layers' "
                          f"{cfg.swa_num_key_value_heads} KV heads (2 * num_key_value_heads)")  # fmt: skip
