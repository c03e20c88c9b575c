"""config.json of the DeepSeek Sparse Attention (DSA) family -> the indexer fields of ModelConfig.

`deepseek_v32` (DeepSeek-V3.2, `DeepseekV32ForCausalLM`) and `glm_moe_dsa` (GLM-5, `GlmMoeDsaForCausalLM`) are MLA
(models/mla.py) plus a lightning indexer per attention layer (models/dsa.py): `index_n_heads` heads of
`index_head_dim` score every cached position through the layer's own cached indexer keys, and each query attends
only to the `index_topk` best. GLM-5 may mark layers "shared" (`indexer_types`, or `index_topk_freq` /
`index_skip_topk_offset`): those have no indexer and reuse the last full layer's top-k (ModelConfig.index_pattern).
models/config.py calls `dsa_fields` for these model types.
"""

from __future__ import annotations

from typing import Any

from models.config_fields import ConfigError, Fields

DSA_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
DSA_ARCHITECTURES = {"deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}
# The indexer's rope: DeepSeek-V3.2 rotates its first qk_rope_head_dim dims as halves (neox), GLM-5 as interleaved
# pairs (transformers `apply_rotary_pos_emb` vs `apply_rotary_pos_emb_interleave` in the two indexers).
INTERLEAVED_INDEXER_ROPE = ("glm_moe_dsa",)

# Import rows (models/checkpoint.py `Rule` fields): the indexer of main layer i and of MTP module j (renamed
# model.layers.MTP{j} by the importer) -> the canonical `self_attn.indexer.*` of models/dsa.py.
_INDEXER = r"self_attn\.indexer\.(wq_b|wk|k_norm|weights_proj)\.(weight|bias)"
DSA_RULES: tuple[tuple[str, str, str], ...] = (
    (r"model\.layers\.MTP(\d+)\." + _INDEXER, r"mtp.\1.block.self_attn.indexer.\2.\3", ""),
    (r"model\.layers\.(\d+)\." + _INDEXER, r"layers.\1.self_attn.indexer.\2.\3", ""),
)


def indexer_types(hf: dict[str, Any], num_layers: int) -> list[str]:
    """GLM-5's per-layer indexer mode ("full" or "shared"), derived as transformers' GlmMoeDsaConfig does."""
    types = hf.get("indexer_types")
    if types is not None:
        return list(types) if isinstance(types, list) else [str(types)]
    pattern = hf.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
    f = Fields(hf)
    freq = max(f.integer("index_topk_freq", 1), 1)
    offset = f.integer("index_skip_topk_offset", 2, minimum=0)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]


def dsa_fields(hf: dict[str, Any], f: Fields) -> dict[str, Any]:
    """The indexer fields of a DSA config.json (validated field by field); {} for every other model type."""
    model_type = hf.get("model_type")
    if model_type not in DSA_MODEL_TYPES:
        return {}
    if not f.integer("q_lora_rank", 0, minimum=0):
        raise ConfigError(f"{model_type} needs q_lora_rank > 0: its indexer reads the query latent "
                          "q_a_layernorm(q_a_proj(x)); fix config.json")  # fmt: skip
    if f.raw.get("rope_interleave") is False:
        raise ConfigError(f"{model_type} always ropes its MLA rows as interleaved pairs; remove rope_interleave=false "
                          "from config.json")  # fmt: skip
    num_layers = f.integer("num_hidden_layers")
    types = indexer_types(hf, num_layers) if model_type == "glm_moe_dsa" else ["full"] * num_layers
    if len(types) != num_layers or any(t not in ("full", "shared") for t in types) or types[0] != "full":
        raise ConfigError(f"indexer_types must list {num_layers} entries of 'full' / 'shared', the first 'full' (a "
                          f"shared layer reuses the last full layer's top-k), got {types}; fix config.json")  # fmt: skip
    return {
        "index_n_heads": f.integer("index_n_heads", 64 if model_type == "deepseek_v32" else 32),
        "index_head_dim": f.integer("index_head_dim", 128),
        "index_topk": f.integer("index_topk", 2048),
        "index_pattern": "" if "shared" not in types else "".join("S" if t == "shared" else "F" for t in types),
    }


def validate_dsa(cfg: Any) -> None:
    """Cross-field checks of a DSA ModelConfig (its indexer keys share the MLA latent pool's row width)."""
    if not cfg.index_topk:
        return
    if cfg.model_type not in DSA_MODEL_TYPES:
        raise ConfigError(f"index_topk is set for {cfg.model_type}; sparse attention is for {DSA_MODEL_TYPES} only")
    if cfg.index_n_heads <= 0 or cfg.index_head_dim <= 0:
        raise ConfigError(f"index_n_heads={cfg.index_n_heads} and index_head_dim={cfg.index_head_dim} must be > 0")
    if not cfg.qk_rope_head_dim <= cfg.index_head_dim <= cfg.qk_rope_head_dim + cfg.kv_lora_rank:
        raise ConfigError(f"index_head_dim={cfg.index_head_dim} must be in [qk_rope_head_dim, qk_rope_head_dim + "
                          f"kv_lora_rank] = [{cfg.qk_rope_head_dim}, {cfg.qk_rope_head_dim + cfg.kv_lora_rank}]: the "
                          "indexer ropes its first qk_rope_head_dim dims and its keys live in latent-pool rows")  # fmt: skip
    if cfg.q_lora_rank <= 0:
        raise ConfigError(f"{cfg.model_type} needs q_lora_rank > 0 (its indexer reads the query latent)")
    pattern = cfg.index_pattern
    if pattern and (len(pattern) != cfg.num_hidden_layers or set(pattern) - {"F", "S"} or pattern[0] != "F"):
        raise ConfigError(f"index_pattern {pattern!r} must have one 'F' (own indexer) or 'S' (shared top-k) per main "
                          f"layer ({cfg.num_hidden_layers}), starting with 'F'")  # fmt: skip


def dsa_hf_fields(cfg: Any) -> dict[str, Any]:
    """The config.json fields of a DSA model beyond the MLA ones (inverse of `dsa_fields`)."""
    if not cfg.index_topk:
        return {}
    out: dict[str, Any] = {"architectures": [DSA_ARCHITECTURES[cfg.model_type]], "index_n_heads": cfg.index_n_heads,
                           "index_head_dim": cfg.index_head_dim, "index_topk": cfg.index_topk}  # fmt: skip
    if cfg.model_type == "glm_moe_dsa":
        out["indexer_types"] = ["shared" if c == "S" else "full" for c in cfg.index_pattern or "F" * cfg.num_hidden_layers]
    return out
