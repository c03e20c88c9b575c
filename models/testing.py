"""Tiny random models and checkpoints for tests and benchmarks (no model hub: tests make their own)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from models.checkpoint import save_hf_checkpoint, to_hf_config
from models.config import ModelConfig
from models.fp8 import SCALE_SUFFIX, quantize
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


def is_fp8_quantized(name: str, shape: tuple[int, ...]) -> bool:
    """The tensors DeepSeek-V3 / GLM-4.5-FP8 ship in FP8: the 2-D projection weights (not embeddings, the
    LM head, norms or the router)."""
    return len(shape) == 2 and name.endswith("_proj.weight")


def quantize_checkpoint_fp8(src: str | Path, dst: str | Path) -> None:
    """Re-save a (tiny) float checkpoint as the FP8 release format: float8_e4m3fn projection weights, each with
    a float32 `*_scale_inv` [ceil(out/128), ceil(in/128)] (amax per 128x128 block / 448), and the config's
    quantization_config. Other files (tokenizer) are copied."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    out: dict[str, torch.Tensor] = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if is_fp8_quantized(name, tuple(t.shape)):
            out[name], out[name + SCALE_SUFFIX] = quantize(t)
        else:
            out[name] = t
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    hf = json.loads((src / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                 "activation_scheme": "dynamic"}  # fmt: skip
    (dst / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json") and f.is_file():
            shutil.copyfile(f, dst / f.name)
