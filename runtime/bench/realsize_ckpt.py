"""A random-weight GLM-4.5-Air-shaped checkpoint of about 1.6 GB in bf16, for the realistic-size bench.

    python -m runtime.bench.realsize_ckpt --output build/realsize/air2

The shipped models fit in this machine's L3 cache, so they measure fixed cost. This one does not: one decode
token reads ~0.9 GB of weights, so a forward is bound by memory bandwidth (docs/PERFORMANCE.md, "Realistic size").

Every per-layer matrix has GLM-4.5-Air's published shape (zai-org/GLM-4.5-Air config.json): hidden 4096, 96 query
heads and 8 KV heads of head_dim 128 (GQA), attention bias, no QK norm, partial rotary 0.5, rope theta 1e6, dense
MLP 10944 wide in layer 0 (first_k_dense_replace 1), routed and shared experts 1408 wide, 1 shared expert, sigmoid
routing with n_group 1, norm_topk_prob. What is cut to fit 1-2 GB (and this machine's 24 GiB RAM while the model is
written in fp32 and converted) and why:
  * 2 main layers (Air: 46): the dense layer 0 and one MoE layer, so both layer kinds are measured; + the 1 MTP layer.
  * 8 routed experts, top-4 (Air: 128, top-8): one Air MoE layer is 4.4 GB; 8 experts keep a MoE layer at 0.53 GB,
    and top-4 of 8 keeps the decode step reading only part of the experts (half; Air reads 1/16).
  * vocabulary 2048 (Air: 151552): the deep model's tokenizer, so llama.cpp tokenizes the same prompt; Air's
    embedding and lm_head alone would be 2.5 GB.
Weights are N(0, 0.02) (norms 1 + small noise), stored bf16 like the released checkpoint; norms and the router bias f32.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from models.checkpoint_export import to_hf_config, to_hf_tensors
from models.checkpoint_hybrid import model_class
from models.config import ModelConfig

DEFAULT_OUT = Path("build/realsize/air2")
TOKENIZER_FROM = Path("models/deep")  # tokenizer.json + tokenizer_config.json + generation_config.json
AIR_CUTS = {"num_hidden_layers": (46, 2), "n_routed_experts": (128, 8), "num_experts_per_tok": (8, 4),
            "vocab_size": (151552, 2048)}  # fmt: skip


def realsize_config(vocab_size: int = 2048) -> ModelConfig:
    """GLM-4.5-Air's layer shapes with the cuts in AIR_CUTS (module docstring)."""
    cfg = ModelConfig(
        model_type="glm4_moe", vocab_size=vocab_size, hidden_size=4096, intermediate_size=10944, num_hidden_layers=2,
        num_attention_heads=96, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=1e6,
        partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=False, first_k_dense_replace=1,
        moe_intermediate_size=1408, n_routed_experts=8, num_experts_per_tok=4, n_group=1, topk_group=1,
        routed_scaling_factor=1.0, norm_topk_prob=True, n_shared_experts=1, num_nextn_predict_layers=1,
        max_position_embeddings=4096, eos_token_id=(0,),
    )  # fmt: skip
    cfg.validate()
    return cfg


def _keep_f32(name: str) -> bool:
    return name.endswith("norm.weight") or name.endswith("layernorm.weight") or "e_score_correction_bias" in name


def write_checkpoint(out: Path, seed: int = 0, tokenizer_from: Path = TOKENIZER_FROM) -> Path:
    """Write config.json, model.safetensors (bf16 matrices) and the tokenizer files to `out`; returns `out`."""
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        print(f"{out}: already written", flush=True)
        return out
    vocab = json.loads((tokenizer_from / "config.json").read_text())["vocab_size"]
    cfg = realsize_config(vocab)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    model = model.to_empty(device="cpu")  # no default init: every parameter is written below; buffers are not saved
    g = torch.Generator().manual_seed(seed)
    params = list(model.named_parameters())
    with torch.no_grad(), tqdm(total=sum(p.numel() for _, p in params), unit="param", unit_scale=True,
                               desc="random weights") as bar:  # fmt: skip
        for name, p in params:
            if _keep_f32(name) and "bias" not in name:
                p.copy_(1.0 + 0.05 * torch.randn(p.shape, generator=g))
            elif "e_score_correction_bias" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.normal_(0.0, 0.02, generator=g)
            bar.update(p.numel())
    tensors = to_hf_tensors(model)
    del model
    for name in tqdm(list(tensors), desc="to bf16"):
        if not _keep_f32(name) and tensors[name].is_floating_point():
            tensors[name] = tensors[name].to(torch.bfloat16).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    print(f"writing {out / 'model.safetensors'} ...", flush=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = to_hf_config(cfg)
    hf["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (tokenizer_from / f).is_file():
            shutil.copy(tokenizer_from / f, out / f)
    return out


def checkpoint_bytes(out: Path) -> int:
    return (out / "model.safetensors").stat().st_size


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", type=Path, default=DEFAULT_OUT)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = write_checkpoint(args.output, args.seed)
    print(f"{out}: {checkpoint_bytes(out) / 1e9:.2f} GB", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
