"""ModelConfig: the architecture numbers of one GLM-4.5 / DeepSeek-V3-layout model.

Built from a Hugging Face `config.json` by `ModelConfig.from_hf_dict`, which validates every field it
needs and names the missing or bad one. Knows nothing about checkpoints, engines or devices.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("glm4_moe",)


class ConfigError(ValueError):
    """A configuration that cannot work (config.json, runtime limits, flags); the message names the fix."""


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
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        d["eos_token_id"] = tuple(d.get("eos_token_id", ()))
        return cls(**d)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        """Validate a Hugging Face config.json dict and convert it."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r} in config.json; supported: {', '.join(SUPPORTED_MODEL_TYPES)} "
                "(DeepSeek-V3, MiMo and Qwen3-Next layouts are planned additions to models/checkpoint.py's table)"
            )
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
        missing = [k for k in required if k not in hf]
        if missing:
            raise ConfigError(f"config.json is missing required field(s) {missing}; add them (see the HF Glm4MoeConfig)")
        heads = int(hf["num_attention_heads"])
        head_dim = int(hf.get("head_dim") or hf["hidden_size"] // heads)
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ConfigError(f"rope_type {rope_type!r} is not supported yet; only 'default' RoPE is")
        eos = hf.get("eos_token_id")
        eos_ids: tuple[int, ...] = () if eos is None else (tuple(eos) if isinstance(eos, list) else (int(eos),))
        n_experts = int(hf.get("n_routed_experts") or 0)
        cfg = cls(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))),
            attention_bias=bool(hf.get("attention_bias", False)),
            use_qk_norm=bool(hf.get("use_qk_norm", False)),
            first_k_dense_replace=int(hf.get("first_k_dense_replace", 1 if n_experts else 0)),
            moe_intermediate_size=int(hf.get("moe_intermediate_size") or 0),
            n_routed_experts=n_experts,
            num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0),
            n_group=int(hf.get("n_group") or 1),
            topk_group=int(hf.get("topk_group") or 1),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            n_shared_experts=int(hf.get("n_shared_experts") or 0),
            num_nextn_predict_layers=int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            eos_token_id=eos_ids,
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
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
