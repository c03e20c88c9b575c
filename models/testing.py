"""Tiny random models and checkpoints for tests and benchmarks (no model hub: tests make their own)."""

from __future__ import annotations

from pathlib import Path

import torch

from models.checkpoint import save_hf_checkpoint, to_hf_config
from models.config import ModelConfig
from models.glm4_moe import Glm4MoeMTPModel


def tiny_config(**overrides) -> ModelConfig:
    """A 2-layer (1 dense + 1 MoE) GQA model with one MTP module; override any field."""
    base = dict(
        model_type="glm4_moe",
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        partial_rotary_factor=0.5,
        first_k_dense_replace=1,
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        routed_scaling_factor=1.5,
        num_nextn_predict_layers=1,
        max_position_embeddings=512,
    )
    base.update(overrides)
    cfg = ModelConfig(**base)  # type: ignore[arg-type]
    cfg.validate()
    return cfg


def init_random(model: Glm4MoeMTPModel, seed: int = 0, std: float = 0.1, norm_noise: float = 0.1) -> None:
    """Random weights with non-trivial norms and router bias, so every parameter matters in parity tests."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + norm_noise * torch.randn(p.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))


def random_model(cfg: ModelConfig, seed: int = 0) -> Glm4MoeMTPModel:
    model = Glm4MoeMTPModel(cfg)
    init_random(model, seed)
    return model.eval()


def make_checkpoint(path: str | Path, cfg: ModelConfig, seed: int = 0) -> Glm4MoeMTPModel:
    """Write a random model as a Hugging Face checkpoint directory (MTP at model.layers.{L+j}.*)."""
    model = random_model(cfg, seed)
    save_hf_checkpoint(model, to_hf_config(cfg), path)
    return model
