"""ModelConfig: the architecture numbers of one GLM-4.5 / DeepSeek-V3-layout model.

Built from a Hugging Face `config.json` by `ModelConfig.from_hf_dict`, which validates every field it
needs and names the missing or bad one. Knows nothing about checkpoints, engines or devices.
"""

from __future__ import annotations

import dataclasses
import math
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
    def from_hf_dict(cls, hf: Any) -> ModelConfig:
        """Validate a Hugging Face config.json dict and convert it; a bad field is named with what it must be."""
        if not isinstance(hf, dict):
            raise ConfigError(f"must be a JSON object, got a {type(hf).__name__}; is this a Hugging Face config?")
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r} in config.json; supported: {', '.join(SUPPORTED_MODEL_TYPES)} "
                "(DeepSeek-V3, MiMo and Qwen3-Next layouts are planned additions to models/checkpoint.py's table)"
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
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ConfigError(f"rope_type {rope_type!r} is not supported yet; only 'default' RoPE is")
        rf = _Fields(rope, prefix="rope_parameters.")
        n_experts = f.integer("n_routed_experts", 0, minimum=0)
        cfg = cls(
            model_type=model_type,
            vocab_size=f.integer("vocab_size"),
            hidden_size=hidden,
            intermediate_size=f.integer("intermediate_size"),
            num_hidden_layers=f.integer("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=f.integer("num_key_value_heads", heads),
            head_dim=f.integer("head_dim", hidden // heads),
            rms_norm_eps=f.number("rms_norm_eps", 1e-5),
            rope_theta=rf.number("rope_theta", f.number("rope_theta", 10000.0)),
            partial_rotary_factor=rf.number("partial_rotary_factor", f.number("partial_rotary_factor", 0.5)),
            attention_bias=f.flag("attention_bias", False),
            use_qk_norm=f.flag("use_qk_norm", False),
            first_k_dense_replace=f.integer("first_k_dense_replace", 1 if n_experts else 0, minimum=0),
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
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Cross-field checks (single fields are checked where they are parsed, by `_Fields`)."""
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


def _eos_ids(eos: Any) -> tuple[int, ...]:
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ConfigError(f"eos_token_id must be a token id or a list of them (integers >= 0), got {eos!r}")
    return tuple(ids)


class _Fields:
    """Typed reads of config.json fields; null counts as absent (HF configs write null for "default")."""

    def __init__(self, raw: dict[str, Any], prefix: str = "") -> None:
        self.raw, self.prefix = raw, prefix

    def _bad(self, key: str, what: str, value: Any) -> ConfigError:
        kind = "" if isinstance(value, int | float) and not isinstance(value, bool) else f" (a {type(value).__name__})"
        return ConfigError(f"{self.prefix}{key} must be {what}, got {value!r}{kind}; fix config.json")

    def integer(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        value = self.raw.get(key)
        if value is None:
            if default is None:
                raise ConfigError(f"config.json is missing required field {self.prefix}{key}")
            return default
        ok = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        if isinstance(value, bool) or not ok or value < minimum:
            raise self._bad(key, f"an integer >= {minimum}", value)
        return int(value)

    def number(self, key: str, default: float) -> float:
        value = self.raw.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise self._bad(key, "a finite number > 0", value)
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.raw.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._bad(key, "true or false", value)
        return value
