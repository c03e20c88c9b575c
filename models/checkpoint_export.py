"""Export: our model's weights and config back to a Hugging Face checkpoint (the inverse of models/checkpoint.py).

Used to ship the trained models (models/training) and to write the tiny test checkpoints (models/testing.py),
which transformers then loads as the independent reference.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from models.checkpoint import deinterleave_rope_rows
from models.config import ModelConfig, mla_hf_fields
from models.glm4_moe import Glm4MoeMTPModel


def to_hf_tensors(model: Glm4MoeMTPModel) -> dict[str, torch.Tensor]:
    """Canonical weights -> Hugging Face checkpoint names (inverse of GLM4_MOE_RULES; MTP shares head)."""
    cfg = model.cfg
    out: dict[str, torch.Tensor] = {}
    for name, t in deinterleave_rope_rows(cfg, dict(model.state_dict()), inverse=True).items():
        t = t.detach().contiguous()
        m = re.match(r"(layers\.(\d+)|mtp\.(\d+)\.block)\.mlp\.(w_gate_up|w_down)$", name)
        prefix = _hf_prefix(name, cfg.num_hidden_layers)
        if m:
            for e in range(t.shape[0]):
                if m.group(4) == "w_down":
                    out[f"{prefix}.mlp.experts.{e}.down_proj.weight"] = t[e].clone()
                else:
                    gate, up = t[e].chunk(2, dim=0)
                    out[f"{prefix}.mlp.experts.{e}.gate_proj.weight"] = gate.clone()
                    out[f"{prefix}.mlp.experts.{e}.up_proj.weight"] = up.clone()
        elif name == "lm_head.weight":
            out[name] = t.clone()
        elif name.startswith("mtp."):
            rest = name.split(".", 2)[2]
            rest = rest.replace("block.", "", 1).replace("final_norm", "shared_head.norm")
            out[f"{prefix}.{rest}"] = t.clone()
        else:
            out[f"model.{name}"] = t.clone()
    return out


def _hf_prefix(name: str, num_layers: int) -> str:
    m = re.match(r"layers\.(\d+)", name)
    if m:
        return f"model.layers.{m.group(1)}"
    m = re.match(r"mtp\.(\d+)", name)
    if m:
        return f"model.layers.{num_layers + int(m.group(1))}"
    return "model"


def save_hf_checkpoint(model: Glm4MoeMTPModel, hf_config: dict, path: str | Path) -> None:
    """Write config.json + model.safetensors in the Hugging Face Glm4Moe layout (loadable by transformers)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(to_hf_tensors(model), str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")


def to_hf_config(cfg: ModelConfig) -> dict:
    """A Hugging Face config dict for `cfg` (what save_hf_checkpoint writes as config.json): Glm4MoeConfig, or
    for MLA models DeepseekV3Config / Glm4MoeLiteConfig (models/config.py `mla_hf_fields`)."""
    hf = {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": cfg.partial_rotary_factor,
        },
        "attention_bias": cfg.attention_bias,
        "use_qk_norm": cfg.use_qk_norm,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "n_routed_experts": cfg.n_routed_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "norm_topk_prob": cfg.norm_topk_prob,
        "n_shared_experts": cfg.n_shared_experts,
        "num_nextn_predict_layers": cfg.num_nextn_predict_layers,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "eos_token_id": list(cfg.eos_token_id) or None,
        "dtype": "float32",
    }
    if cfg.is_mla:  # no GQA head_dim / qk-norm; the MLA dims, rope scaling and architecture instead
        hf = {k: v for k, v in hf.items() if k not in ("head_dim", "use_qk_norm")} | mla_hf_fields(cfg)
    return hf
