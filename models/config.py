"""ModelConfig: the architecture numbers of one GLM-4.5 / DeepSeek-V3-layout model.

Built from a Hugging Face `config.json` by `ModelConfig.from_hf_dict`, which validates every field it
needs and names the missing or bad one. Knows nothing about checkpoints, engines or devices.

Two attention kinds: GQA (`glm4_moe`: per-head K/V, partial neox RoPE) and MLA (`deepseek_v3`,
`glm4_moe_lite`: low-rank latent K/V, `is_mla`), whose RoPE may be YaRN-scaled (`rope_type`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from models.config_dsa import DSA_MODEL_TYPES, dsa_fields, validate_dsa
from models.config_fields import ConfigError as ConfigError  # re-exported: callers import it from here
from models.config_fields import Fields as _Fields
from models.config_fields import eos_ids as _eos_ids
from models.config_hybrid import hybrid_fields, validate_hybrid
from models.config_mimo_v2 import mimo_v2_fields, validate_mimo_v2
from models.config_mla import MLA_MODEL_TYPES as MLA_MODEL_TYPES  # re-exported
from models.config_mla import mla_fields as _mla_fields
from models.config_mla import mla_hf_fields as mla_hf_fields  # re-exported

# Gated DeltaNet + gated attention: Qwen3-Next, Qwen3.5 MoE and dense (text model, or the multimodal release)
HYBRID_MODEL_TYPES = ("qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe", "qwen3_5_text", "qwen3_5")
# MTP families users ask for that the engine cannot run yet, each with what is missing (docs/MODELS.md).
NAMED_REFUSALS = {
    "deepseek_v4": "DeepSeek-V4's MTP adds e_proj(embedding) + h_proj(hidden) instead of concatenating them, its hidden "
                   "state has 4 hyper-connection lanes collapsed by hc_head, and its attention is compressed "
                   "(C4A/C128A); none of these is implemented",
    "glm5_next": ("GLM-5.3-Flash is MLA plus sparse attention (glm_moe_dsa) with hyper-connection lanes collapsed "
                   "by hc_head; the hyper-connections are not implemented"),
}
SUPPORTED_MODEL_TYPES = ("glm4_moe", "deepseek_v3", "glm4_moe_lite", "mimo", "mimo_v2_flash", *HYBRID_MODEL_TYPES,
                         *DSA_MODEL_TYPES)  # fmt: skip
ROPE_TYPES = ("default", "yarn")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP width (first `first_k_dense_replace` layers)
    num_hidden_layers: int  # main decoder layers; MTP modules are numbered after them
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.5  # GLM-4.5 rotates half of each head (neox style, first dims)
    attention_bias: bool = False
    use_qk_norm: bool = False
    # MoE (layers >= first_k_dense_replace; MTP blocks are always MoE, as in HF `get_mtp_config`)
    first_k_dense_replace: int = 1
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    n_shared_experts: int = 0
    num_nextn_predict_layers: int = 0  # number of MTP modules in the checkpoint (0 = MTP unavailable)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    eos_token_id: tuple[int, ...] = ()
    # MLA (kv_lora_rank > 0; all 0 for GQA models). head_dim is qk_rope_head_dim there, as in HF.
    q_lora_rank: int = 0  # 0 = plain q_proj (no q_a_proj / q_a_layernorm / q_b_proj)
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # checkpoint rope rows in interleaved pairs (de-interleaved at import)
    # RoPE scaling (rope_parameters / rope_scaling); "yarn" fields as in HF `_compute_yarn_parameters`
    rope_type: str = "default"
    rope_factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    rope_mscale: float = 0.0  # 0 = absent
    rope_mscale_all_dim: float = 0.0  # 0 = absent (no softmax-scale correction)
    rope_attention_factor: float = 0.0  # 0 = derived from factor / mscale / mscale_all_dim
    rope_truncate: bool = True
    # Hybrid Gated-DeltaNet models (HYBRID_MODEL_TYPES; models/qwen3_next.py): which main layers are GDN, the GDN
    # dims, and the sigmoid-gated shared expert's width. Empty / 0 for every other model.
    layer_types: tuple[str, ...] = ()  # per main layer: "linear_attention" (GDN) | "full_attention"
    linear_conv_kernel_dim: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    shared_expert_intermediate_size: int = 0
    # DeepSeek Sparse Attention (DSA_MODEL_TYPES; models/config_dsa.py, models/dsa.py): the lightning indexer's heads
    # and dim, and how many cached positions each query attends to. index_topk 0 = dense attention (every other model).
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    index_pattern: str = ""  # GLM-5: one char per main layer, "F" runs its indexer, "S" reuses the last F's top-k
    # MiMo-V2-Flash (models/config_mimo_v2.py, models/mimo_v2.py): layer_types "sliding_attention" | "full_attention";
    # 0 for every other model. v_head_dim (above) is its value head width.
    sliding_window: int = 0  # keys a sliding layer's query sees, itself included (transformers' convention)
    swa_num_key_value_heads: int = 0
    swa_rope_theta: float = 0.0
    attention_value_scale: float = 1.0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_dsa(self) -> bool:
        return self.index_topk > 0

    @property
    def is_hybrid(self) -> bool:
        return self.model_type in HYBRID_MODEL_TYPES

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        """Main layers that are Gated DeltaNet (recurrent state, no KV), in order."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def gdn_conv_dim(self) -> int:
        """Channels of the GDN causal conv (q, k, v mixed): 2 * Hk * Dk + Hv * Dv."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * \
            self.linear_value_head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_mtp_modules(self) -> int:
        return self.num_nextn_predict_layers

    @property
    def has_moe(self) -> bool:
        return self.n_routed_experts > 0

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.has_moe and layer_idx >= self.first_k_dense_replace

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_id"] = list(self.eos_token_id)
        d["layer_types"] = list(self.layer_types)
        # MLA / rope-scaling fields at their defaults are left out, so a GQA engine's config.json is byte for
        # byte what it was before these fields existed (from_dict fills the defaults back in).
        for f in dataclasses.fields(self):
            if f.name in _OPTIONAL_FIELDS and d[f.name] == ([] if f.name == "layer_types" else f.default):
                del d[f.name]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        d["eos_token_id"] = tuple(d.get("eos_token_id", ()))
        d["layer_types"] = tuple(d.get("layer_types", ()))
        return cls(**d)

    @classmethod
    def from_hf_dict(cls, hf: Any) -> ModelConfig:
        """Validate a Hugging Face config.json dict and convert it; a bad field is named with what it must be."""
        if not isinstance(hf, dict):
            raise ConfigError(f"must be a JSON object, got a {type(hf).__name__}; is this a Hugging Face config?")
        model_type = hf.get("model_type")
        if model_type in HYBRID_MODEL_TYPES:  # Qwen3-Next / Qwen3.5: their own field names (models/config_hybrid.py)
            cfg = cls(**hybrid_fields(hf))
            cfg.validate()
            return cfg
        if model_type == "mimo_v2_flash":  # its own field names and defaults (models/config_mimo_v2.py)
            cfg = cls(**mimo_v2_fields(hf))
            cfg.validate()
            return cfg
        if model_type in NAMED_REFUSALS:
            raise ConfigError(f"model_type {model_type!r} is not supported: {NAMED_REFUSALS[model_type]} "
                              "(docs/MODELS.md \"Not supported\")")  # fmt: skip
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r} in config.json; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
        missing = [k for k in required if hf.get(k) is None]
        if missing:
            raise ConfigError(f"config.json is missing required field(s) {missing}; add them (see the HF Glm4MoeConfig)")
        f = _Fields(hf)
        heads = f.integer("num_attention_heads")
        hidden = f.integer("hidden_size")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
            raise ConfigError(f"{key} must be a JSON object, got {rope!r}; fix config.json")
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        if rope_type not in ROPE_TYPES:
            raise ConfigError(f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        rf = _Fields(rope, prefix="rope_parameters.")
        mla = _mla_fields(model_type, f, rf, rope_type)
        if model_type == "mimo":
            _check_mimo(hf)
        n_experts = f.integer("n_routed_experts", 0, minimum=0)
        mimo = model_type == "mimo"
        cfg = cls(
            model_type=model_type,
            vocab_size=f.integer("vocab_size"),
            hidden_size=hidden,
            intermediate_size=f.integer("intermediate_size"),
            num_hidden_layers=f.integer("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=f.integer("num_key_value_heads", heads),
            head_dim=mla.get("qk_rope_head_dim") or f.integer("head_dim", hidden // heads),
            rms_norm_eps=f.number("rms_norm_eps", 1e-5),
            rope_theta=rf.number("rope_theta", f.number("rope_theta", 10000.0)),
            partial_rotary_factor=rf.number("partial_rotary_factor",
                                            f.number("partial_rotary_factor", 1.0 if mla or mimo else 0.5)),  # fmt: skip
            attention_bias=mimo or f.flag("attention_bias", False),  # Qwen2 (MiMo's trunk): q/k/v always biased
            use_qk_norm=f.flag("use_qk_norm", False),
            first_k_dense_replace=_first_k_dense(hf, f, 1 if n_experts else 0),
            moe_intermediate_size=f.integer("moe_intermediate_size", 0, minimum=0),
            n_routed_experts=n_experts,
            num_experts_per_tok=f.integer("num_experts_per_tok", 0, minimum=0),
            n_group=f.integer("n_group", 1),
            topk_group=f.integer("topk_group", 1),
            routed_scaling_factor=f.number("routed_scaling_factor", 1.0),
            norm_topk_prob=f.flag("norm_topk_prob", True),
            n_shared_experts=f.integer("n_shared_experts", 0, minimum=0),
            num_nextn_predict_layers=f.integer("num_nextn_predict_layers", f.integer("num_mtp_layers", 0, minimum=0),
                                           minimum=0),  # fmt: skip
            tie_word_embeddings=f.flag("tie_word_embeddings", False),
            max_position_embeddings=f.integer("max_position_embeddings", 4096),
            eos_token_id=_eos_ids(hf.get("eos_token_id")),
            **mla,
            **dsa_fields(hf, f),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Cross-field checks (single fields are checked where they are parsed, by `_Fields`)."""
        if self.is_mla:  # first: its messages name the MLA field at fault, not the GQA fields derived from it
            self._validate_mla()
        if self.is_hybrid:
            validate_hybrid(self)
        validate_dsa(self)
        if self.sliding_window:
            validate_mimo_v2(self)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}; GQA needs whole groups"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ConfigError(f"partial_rotary_factor={self.partial_rotary_factor} gives odd/empty rotary dim")
        if self.has_moe:
            if self.moe_intermediate_size <= 0 or self.num_experts_per_tok <= 0:
                raise ConfigError("MoE config needs moe_intermediate_size > 0 and num_experts_per_tok > 0")
            if self.n_routed_experts % self.n_group or self.topk_group > self.n_group:
                raise ConfigError(
                    f"n_routed_experts={self.n_routed_experts} must split into n_group={self.n_group} groups "
                    f"and topk_group={self.topk_group} <= n_group"
                )
            if self.num_experts_per_tok > self.n_routed_experts:
                raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} must be <= n_routed_experts="
                                  f"{self.n_routed_experts} (a token cannot pick more experts than exist)")  # fmt: skip
        for eos in self.eos_token_id:
            if not 0 <= eos < self.vocab_size:
                raise ConfigError(f"eos_token_id {eos} is outside the vocabulary (vocab_size={self.vocab_size})")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ConfigError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        if not self.is_mla and self.rope_type != "default":
            raise ConfigError(f"rope scaling {self.rope_type!r} is supported for MLA models only "
                              f"({', '.join(MLA_MODEL_TYPES)}); {self.model_type} takes rope_type 'default'")  # fmt: skip

    def _validate_mla(self) -> None:
        dims = {"kv_lora_rank": self.kv_lora_rank, "qk_nope_head_dim": self.qk_nope_head_dim,
                "qk_rope_head_dim": self.qk_rope_head_dim, "v_head_dim": self.v_head_dim}  # fmt: skip
        bad = [f"{k}={v}" for k, v in dims.items() if v <= 0]
        if bad:
            raise ConfigError(f"MLA dims must be > 0, got {', '.join(bad)}; fix config.json")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim} is odd; RoPE rotates pairs, it must be even")
        if self.q_lora_rank < 0:
            raise ConfigError(f"q_lora_rank={self.q_lora_rank} must be >= 0 (0 or null = plain q_proj)")
        if self.head_dim != self.qk_rope_head_dim or self.partial_rotary_factor != 1.0:
            raise ConfigError(f"MLA ropes the whole qk_rope_head_dim={self.qk_rope_head_dim} key: head_dim must equal "
                              f"it and partial_rotary_factor must be 1 (got head_dim={self.head_dim}, "
                              f"partial_rotary_factor={self.partial_rotary_factor}); fix config.json")  # fmt: skip
        if self.num_key_value_heads != self.num_attention_heads:
            raise ConfigError(f"MLA expands K/V for every query head: num_key_value_heads={self.num_key_value_heads} "
                              f"must equal num_attention_heads={self.num_attention_heads}; fix config.json")  # fmt: skip
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(f"rope_type {self.rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        if self.rope_type == "yarn" and self.original_max_position_embeddings <= 0:
            raise ConfigError("yarn rope needs original_max_position_embeddings > 0; fix config.json")


_OPTIONAL_FIELDS = frozenset({
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave",
    "rope_type", "rope_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "rope_mscale",
    "rope_mscale_all_dim", "rope_attention_factor", "rope_truncate", "layer_types", "linear_conv_kernel_dim",
    "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
    "shared_expert_intermediate_size", "index_n_heads", "index_head_dim", "index_topk", "index_pattern",
    "sliding_window", "swa_num_key_value_heads", "swa_rope_theta", "attention_value_scale",
})  # fmt: skip


def _check_mimo(hf: dict[str, Any]) -> None:
    """MiMo = a Qwen2 trunk: refuse what its import does not implement (sliding-window attention)."""
    if hf.get("use_sliding_window"):
        raise ConfigError("use_sliding_window=true is not supported for mimo (full attention only); set it to false")
    types = hf.get("layer_types")
    if types is not None and (not isinstance(types, list) or any(t != "full_attention" for t in types)):
        raise ConfigError(f"mimo layer_types must all be 'full_attention', got {types!r}; sliding-window layers "
                          "are not supported")  # fmt: skip


def _first_k_dense(hf: dict[str, Any], f: _Fields, default: int) -> int:
    """first_k_dense_replace, or (glm4_moe_lite) the dense prefix of mlp_layer_types."""
    types = hf.get("mlp_layer_types")
    if types is None:
        return f.integer("first_k_dense_replace", default, minimum=0)
    if not isinstance(types, list) or any(t not in ("dense", "sparse") for t in types):
        raise ConfigError(f'mlp_layer_types must be a list of "dense"/"sparse", got {types!r}; fix config.json')
    k = types.index("sparse") if "sparse" in types else len(types)
    if types != ["dense"] * k + ["sparse"] * (len(types) - k):
        raise ConfigError(f"mlp_layer_types {types} interleaves dense and sparse layers; only dense-then-MoE "
                          "(first_k_dense_replace) layouts are supported")  # fmt: skip
    if hf.get("first_k_dense_replace") is not None and f.integer("first_k_dense_replace", 0, minimum=0) != k:
        raise ConfigError(f"first_k_dense_replace={hf['first_k_dense_replace']} disagrees with mlp_layer_types "
                          f"({k} dense layers first); fix config.json")  # fmt: skip
    return k


def kv_geometry_fields(cfg: ModelConfig) -> tuple[int, int, int]:
    """(num_kv_heads, head_dim, kv_kind) of the KV pool `cfg` needs: one latent row for MLA, K/V per head for GQA."""
    if cfg.is_mla:
        return 1, cfg.qk_rope_head_dim + cfg.kv_lora_rank, 1
    if cfg.sliding_window:  # MiMo-V2-Flash: the sliding layers' KV heads; values zero-padded to head_dim
        return max(cfg.num_key_value_heads, cfg.swa_num_key_value_heads), max(cfg.head_dim, cfg.v_head_dim), 0
    return cfg.num_key_value_heads, cfg.head_dim, 0


def num_kv_planes(cfg: ModelConfig) -> int:
    """KV pool planes: one per attention main layer (all of them but a hybrid model's Gated DeltaNet layers), then
    one per MTP module; a DSA model then has as many indexer-key planes again, in the same order (models/dsa.py)."""
    planes = cfg.num_hidden_layers - len(cfg.gdn_layers) + cfg.num_mtp_modules
    return 2 * planes if cfg.is_dsa else planes
