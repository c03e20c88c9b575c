"""Tiny random models and checkpoints for tests and benchmarks (no model hub: tests make their own)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from models.checkpoint_export import save_hf_checkpoint, to_hf_config
from models.checkpoint_hybrid import model_class
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


def tiny_mla_config(model_type: str = "deepseek_v3", **overrides) -> ModelConfig:
    """A 2-layer (1 dense + 1 MoE) MLA model with one MTP module, q_lora and interleaved rope; override any field."""
    base = dict(
        model_type=model_type, vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=8, partial_rotary_factor=1.0, first_k_dense_replace=1,
        moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        n_shared_experts=1, routed_scaling_factor=1.5, num_nextn_predict_layers=1, max_position_embeddings=512,
        rms_norm_eps=1e-6, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=10, qk_rope_head_dim=8, v_head_dim=12,
        rope_interleave=True,
    )  # fmt: skip
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
    model = model_class(cfg)(cfg)
    init_random(model, seed)
    return model.eval()


def make_checkpoint(path: str | Path, cfg: ModelConfig, seed: int = 0) -> Glm4MoeMTPModel:
    """Write a random model as a Hugging Face checkpoint directory (MTP at model.layers.{L+j}.*)."""
    model = random_model(cfg, seed)
    save_hf_checkpoint(model, to_hf_config(cfg), path)
    return model


# --- MLA (DeepSeek-V3 / GLM-4.7-Flash) checkpoints written by transformers itself --------------------------

MLA_BASE = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
    kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=10, v_head_dim=12, n_group=1,
    topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.5, max_position_embeddings=512,
    rope_interleave=True, rms_norm_eps=1e-6, num_nextn_predict_layers=1, eos_token_id=None, bos_token_id=None,
)  # fmt: skip
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}  # fmt: skip

# The parity variants (tests/models/test_mla_parity.py, tests/runtime/test_mla_lossless.py): model_type + overrides.
MLA_VARIANTS: dict[str, tuple[str, dict]] = {
    "dsv3": ("deepseek_v3", dict(n_group=4, topk_group=2)),  # q_lora, grouped routing, interleaved rope
    "dsv3_yarn": ("deepseek_v3", dict(n_group=4, topk_group=2, rope_parameters=YARN)),
    "dsv3_no_qlora": ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False)),
    "dsv3_dense_then_moe_2": ("deepseek_v3", dict(num_hidden_layers=3, first_k_dense_replace=2, n_group=2,
                                                  topk_group=1, attention_bias=True)),  # fmt: skip
    "glm_lite": ("glm4_moe_lite", dict(q_lora_rank=None)),  # GLM-4.7-Flash-like: no q_lora, n_group 1
    "glm_lite_qlora_yarn": ("glm4_moe_lite", dict(rope_parameters=YARN)),
}


def make_mla_checkpoint(path: str | Path, model_type: str = "deepseek_v3", seed: int = 0, **overrides) -> dict:
    """A tiny random DeepSeek-V3 / GLM-4.7-Flash checkpoint saved by transformers' save_pretrained, plus the MTP
    module tensors at model.layers.{L}.* as the released checkpoints store them (per-expert, shared_head.norm,
    and the copies of embed_tokens / shared_head.head that importers ignore). Returns the HF config dict.
    """
    import transformers
    from safetensors.torch import load_file, save_file

    kw = {**MLA_BASE, **overrides}
    kw.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})
    config_cls: Any
    model_cls: Any
    if model_type == "glm4_moe_lite":
        k = kw.pop("first_k_dense_replace")
        kw["mlp_layer_types"] = ["dense"] * k + ["sparse"] * (kw["num_hidden_layers"] - k)
        config_cls, model_cls = transformers.Glm4MoeLiteConfig, transformers.Glm4MoeLiteForCausalLM
    else:
        config_cls, model_cls = transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM
    num_mtp = kw["num_nextn_predict_layers"]
    if model_type == "deepseek_v3":  # its config names the field num_mtp_layers (saved as num_nextn_predict_layers)
        kw["num_mtp_layers"] = kw.pop("num_nextn_predict_layers")
    hf_cfg = config_cls(**kw)
    g = torch.Generator().manual_seed(seed)
    model = model_cls(hf_cfg).eval()
    _randomize(model, g)
    path = Path(path)
    model.save_pretrained(str(path))
    if num_mtp:
        file = path / "model.safetensors"
        tensors = load_file(str(file))
        for j in range(num_mtp):
            tensors.update(_mtp_tensors(model, hf_cfg, model_type, hf_cfg.num_hidden_layers + j, g))
        save_file(tensors, str(file), metadata={"format": "pt"})
    return json.loads((path / "config.json").read_text())


def _randomize(module: torch.nn.Module, g: torch.Generator, std: float = 0.1) -> None:
    """Every weight random (norms near 1, a router bias), so each parameter matters in parity tests."""
    with torch.no_grad():
        for name, p in [*module.named_parameters(), *module.named_buffers()]:
            if name.endswith("inv_freq"):
                continue
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))


def _mtp_tensors(model, hf_cfg, model_type: str, layer: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """One MTP module (an always-MoE decoder block + enorm/hnorm/eh_proj/shared_head.norm) in checkpoint names."""
    cfg = copy.deepcopy(hf_cfg)
    if model_type == "glm4_moe_lite":
        cfg.mlp_layer_types = ["sparse"]
    else:
        cfg.first_k_dense_replace = 0
    block = type(model.model.layers[-1])(cfg, 0).eval()
    _randomize(block, g)
    h, prefix = hf_cfg.hidden_size, f"model.layers.{layer}."
    out: dict[str, torch.Tensor] = {}
    for name, t in block.state_dict().items():
        if name == "mlp.experts.gate_up_proj":  # released checkpoints are per expert: gate rows, then up rows
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = gate.clone()
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = up.clone()
        elif name == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = t[e].clone()
        else:
            out[prefix + name] = t.clone()
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        out[f"{prefix}{norm}.weight"] = 1.0 + 0.1 * torch.randn(h, generator=g)
    out[f"{prefix}eh_proj.weight"] = 0.1 * torch.randn(h, 2 * h, generator=g)
    out[f"{prefix}embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    out[f"{prefix}shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    return out


def is_fp8_quantized(name: str, shape: tuple[int, ...]) -> bool:
    """The tensors DeepSeek-V3 / GLM-4.5-FP8 (and Qwen3-Next-FP8) ship in FP8: the 2-D projection weights (not
    embeddings, the LM head, norms or the router); MLA's kv_a_proj_with_mqa and the GDN in_proj_* included. The DSA
    releases (DeepSeek-V3.2, GLM-5-FP8) ship the lightning indexer's wq_b and wk in FP8 too, its weights_proj float
    (DeepSeek-V3.2's inference code builds that one in the default dtype)."""
    if len(shape) != 2 or name.endswith(".indexer.weights_proj.weight"):
        return False
    return (name.endswith(("_proj.weight", "_proj_with_mqa.weight", ".indexer.wq_b.weight", ".indexer.wk.weight"))
            or ".linear_attn.in_proj_" in name)  # fmt: skip  (Qwen3-Next / 3.5 GDN: in_proj_qkvz, _ba, ...)


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


# --- MiMo (Qwen2 trunk + model.mtp_layers.{j}.*) checkpoints written by transformers' Qwen2 -----------------

MIMO_BASE = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, eos_token_id=None, bos_token_id=None,
)  # fmt: skip


def make_mimo_checkpoint(path: str | Path, seed: int = 0, num_mtp: int = 1, **overrides) -> dict:
    """A tiny random MiMo checkpoint: the trunk saved by transformers' Qwen2ForCausalLM.save_pretrained (transformers
    has no MiMo class; MiMo's trunk IS Qwen2), config.json turned into MiMo's (`model_type: mimo`,
    `num_nextn_predict_layers`), plus MTP layer j at model.mtp_layers.{j}.* as released (a Qwen2 decoder block's
    tensors + token_layernorm, hidden_layernorm, input_proj [H, 2H], final_layernorm). Returns the HF config dict."""
    import transformers
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    hf_cfg = transformers.Qwen2Config(**{**MIMO_BASE, **overrides})
    g = torch.Generator().manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(hf_cfg).eval()
    _randomize(model, g)
    path = Path(path)
    model.save_pretrained(str(path))
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    h = hf_cfg.hidden_size
    for j in range(num_mtp):
        block = Qwen2DecoderLayer(hf_cfg, 0).eval()
        _randomize(block, g)
        prefix = f"model.mtp_layers.{j}."
        tensors.update({prefix + k: v.clone() for k, v in block.state_dict().items()})
        for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
            tensors[f"{prefix}{norm}.weight"] = 1.0 + 0.1 * torch.randn(h, generator=g)
        tensors[f"{prefix}input_proj.weight"] = 0.1 * torch.randn(h, 2 * h, generator=g)
    save_file(tensors, str(file), metadata={"format": "pt"})
    hf = json.loads((path / "config.json").read_text())
    hf.update(model_type="mimo", architectures=["MiMoForCausalLM"], num_nextn_predict_layers=num_mtp)
    (path / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return hf


# --- Qwen3-Next / Qwen3.5-MoE (hybrid Gated DeltaNet) checkpoints written by transformers ----------------------

HYBRID_BASE = dict(
    vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=6, linear_num_key_heads=2,
    linear_num_value_heads=4, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=8,
    num_experts_per_tok=2, max_position_embeddings=512, rms_norm_eps=1e-6, eos_token_id=None, bos_token_id=None,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)  # fmt: skip
TINY_VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=32, patch_size=4,
                   temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)  # fmt: skip


def make_hybrid_checkpoint(path: str | Path, model_type: str = "qwen3_next", seed: int = 0, **overrides) -> dict:
    """A tiny random Qwen3-Next / Qwen3.5-MoE checkpoint saved by transformers' own save_pretrained (layer_types: 3 GDN
    layers then 1 gated-attention layer), plus the MTP module at `mtp.*` as released (`mtp.fc`, the two pre-fc norms,
    `mtp.layers.0.*` with per-expert tensors, `mtp.norm`), which transformers neither builds nor loads.
    model_type "qwen3_5_moe" writes the multimodal release (text model under model.language_model., a tiny vision
    tower under model.visual.). Returns the HF config dict."""
    import transformers

    kw = {**HYBRID_BASE, **overrides}
    dense = model_type in ("qwen3_5_text", "qwen3_5")
    if dense:  # a dense SwiGLU FFN in every layer
        kw = {k: v for k, v in kw.items() if k not in ("moe_intermediate_size", "shared_expert_intermediate_size",
                                                      "num_experts", "num_experts_per_tok")} | {"intermediate_size": 48}
    text_cls, causal_cls, mm_cfg_cls, mm_cls = {
        "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", "", ""),
        "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", "", ""),
        "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "", "Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration"),
        "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", "", ""),
        "qwen3_5": ("Qwen3_5TextConfig", "", "Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
    }[model_type]
    text_cfg = getattr(transformers, text_cls)(**kw)
    g = torch.Generator().manual_seed(seed)
    model: Any
    if mm_cls:
        hf_cfg = getattr(transformers, mm_cfg_cls)(text_config=text_cfg.to_dict(), vision_config=TINY_VISION)
        model = getattr(transformers, mm_cls)(hf_cfg).eval()
    else:
        model = getattr(transformers, causal_cls)(text_cfg).eval()
    _randomize_hybrid(model, g)
    path = Path(path)
    model.save_pretrained(str(path))
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    tensors.update(_hybrid_mtp_tensors(model, text_cfg, g))
    save_file(tensors, str(file), metadata={"format": "pt"})
    hf = json.loads((path / "config.json").read_text())
    (hf.get("text_config") or hf)["mtp_num_hidden_layers"] = 1  # the released configs' key
    (path / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return hf


def _randomize_hybrid(module: torch.nn.Module, g: torch.Generator) -> None:
    """Random weights; zero-centred norms near 0 (scale 1 + w), the GDN output norm near 1, A_log / dt_bias spread."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("norm.weight") or name.endswith("A_log") or name.endswith("dt_bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def _hybrid_mtp_tensors(model: Any, text_cfg: Any, g: torch.Generator) -> dict[str, torch.Tensor]:
    """The MTP module in released checkpoint names: one full-attention MoE decoder layer built from transformers' own
    class (per-expert tensors, as released), fc [H, 2H], pre_fc_norm_embedding / _hidden and norm (zero-centred)."""
    cfg = copy.deepcopy(text_cfg)
    cfg.layer_types = ["full_attention"]
    cfg.num_hidden_layers = 1
    layer_cls = type(model.model.language_model.layers[0] if hasattr(model.model, "language_model") else
                     model.model.layers[0])  # fmt: skip
    block = layer_cls(cfg, 0).eval()
    _randomize_hybrid(block, g)
    out: dict[str, torch.Tensor] = {}
    for name, t in block.state_dict().items():
        if name == "mlp.experts.gate_up_proj":
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                out[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = gate.clone()
                out[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = up.clone()
        elif name == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                out[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = t[e].clone()
        else:
            out[f"mtp.layers.0.{name}"] = t.clone()
    h = text_cfg.hidden_size
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{norm}.weight"] = 0.3 * torch.randn(h, generator=g)
    out["mtp.fc.weight"] = 0.15 * torch.randn(h, 2 * h, generator=g)
    return out
