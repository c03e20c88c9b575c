"""A random-weight Qwen3.5-35B-A3B-shaped hybrid checkpoint of about 1.4 GB in bf16, for the realistic-size bench.

    python -m runtime.bench.realsize_hybrid_ckpt --output build/realsize/a3b

Published config (Qwen/Qwen3.5-35B-A3B config.json, text_config), every per-layer matrix of which is kept: hidden 2048,
40 layers with full attention every 4th (3 Gated DeltaNet : 1 gated attention), 16 query heads / 2 KV heads of
head_dim 256 with the attention output gate (q_proj emits [q ; gate]), zero-centred q/k norms, partial rotary 0.25,
rope theta 1e7; GDN 16 key heads / 32 value heads of 128 (key and value head dims), conv kernel 4; MoE in every layer:
256 routed experts 512 wide, top-8 (softmax, renormalised), one shared expert 512 wide with a sigmoid gate; vocab
248320, untied LM head; 1 MTP layer (full attention + the same MoE). The project's own qwen3_5_moe handling
(models/config_hybrid.py) reads each of these keys; the config below is parsed by it before anything is written.

What is cut to fit 1-2 GB (and this shared machine: the engine build holds a few copies of the weights) and why:
  * 4 main layers (release: 40): one period of the layer pattern, 3 GDN + 1 full attention, so both mixers are
    measured in their published proportion; + the 1 MTP layer (full attention), kept.
  * 32 routed experts (release: 256), top-8 kept: one released MoE layer is 1.6 GB of experts alone (256 x 3 x 2048
    x 512 bf16); 32 keep a layer at 0.2 GB, and top-8 of 32 keeps a decode token reading a quarter of them, so the
    experts' share of the bytes one token reads (~45%) stays near the release's (8 of 256 experts: ~40% of the A3B).
  * vocabulary 2048 (release: 248320): the deep model's tokenizer, so llama.cpp tokenizes the same prompt; the
    release's embedding and LM head alone would be 2 GB.
  * max_position_embeddings 4096 (release: 262144): the bench's 2k-token prompt fits; no tensor depends on it.
Layout: the text-only `qwen3_5_moe_text` / Qwen3_5MoeForCausalLM (the release is the multimodal wrapper
qwen3_5_moe; its vision tower is not imported by either engine), routed experts fused as transformers saves them
(`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]), the MTP module at `mtp.*` as released.
Weights N(0, 0.02) in bf16; norms (zero-centred: ~0, the GDN output norm ~1), A_log and dt_bias f32.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from models.checkpoint_hybrid import model_class
from models.config import ModelConfig

DEFAULT_OUT = Path("build/realsize/a3b")
TOKENIZER_FROM = Path("models/deep")  # tokenizer.json + tokenizer_config.json + generation_config.json
PUBLISHED = {"num_hidden_layers": 40, "num_experts": 256, "num_experts_per_tok": 8, "vocab_size": 248320,
             "max_position_embeddings": 262144}  # fmt: skip
CUTS = {"num_hidden_layers": 4, "num_experts": 32, "vocab_size": 2048, "max_position_embeddings": 4096}


def hf_config(vocab_size: int = CUTS["vocab_size"]) -> dict:
    """The checkpoint's config.json: the published text config with CUTS applied (module docstring)."""
    layers = CUTS["num_hidden_layers"]
    return {
        "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "vocab_size": vocab_size,
        "hidden_size": 2048, "num_hidden_layers": layers, "full_attention_interval": 4,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "attn_output_gate": True,
        "attention_bias": False, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "num_experts": CUTS["num_experts"], "num_experts_per_tok": 8, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "mtp_num_hidden_layers": 1, "tie_word_embeddings": False,
        "max_position_embeddings": CUTS["max_position_embeddings"], "eos_token_id": 0, "dtype": "bfloat16",
    }  # fmt: skip


def model_config(vocab_size: int = CUTS["vocab_size"]) -> ModelConfig:
    cfg = ModelConfig.from_hf_dict(hf_config(vocab_size))
    cfg.validate()
    return cfg


def hf_name(name: str) -> str:
    """Our canonical tensor name -> the release's (the inverse of models/checkpoint_hybrid.py `_hybrid_rules`)."""
    name = name.replace("mlp.w_gate_up", "mlp.experts.gate_up_proj").replace("mlp.w_down", "mlp.experts.down_proj")
    if name.startswith("mtp.0.block."):
        return "mtp.layers.0." + name.removeprefix("mtp.0.block.")
    if name.startswith("mtp.0."):
        return "mtp." + name.removeprefix("mtp.0.")
    return name if name == "lm_head.weight" else "model." + name


def tensor_plan(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """HF name -> (shape, stored dtype) of every tensor the checkpoint holds (the model built on the meta device)."""
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    return {hf_name(n): (tuple(p.shape), torch.float32 if _keep_f32(n) else torch.bfloat16)
            for n, p in model.named_parameters()}  # fmt: skip


def plan_bytes(plan: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in plan.values())


def _keep_f32(name: str) -> bool:
    return name.endswith("norm.weight") or name.endswith(("A_log", "dt_bias"))


def _random(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    if name.endswith("linear_attn.norm.weight"):  # the GDN output norm scales by w itself
        return 1.0 + 0.05 * torch.randn(shape, generator=g)
    if name.endswith("norm.weight"):  # every other norm is zero-centred: the scale is 1 + w
        return 0.05 * torch.randn(shape, generator=g)
    if name.endswith("A_log"):  # transformers' init: A ~ U(0, 16)
        return torch.empty(shape).uniform_(1.0, 16.0, generator=g).log()
    if name.endswith("dt_bias"):
        return torch.ones(shape)
    return torch.empty(shape).normal_(0.0, 0.02, generator=g)


def write_checkpoint(out: Path, seed: int = 0, tokenizer_from: Path = TOKENIZER_FROM) -> Path:
    """Write config.json, model.safetensors and the tokenizer files to `out` (one tensor in memory at a time while
    drawn, in its stored dtype after); returns `out`."""
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        print(f"{out}: already written", flush=True)
        return out
    vocab = json.loads((tokenizer_from / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    tensors = {name: _random(name, shape, g).to(dtype).contiguous()
               for name, (shape, dtype) in tensor_plan(model_config(vocab)).items()}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(vocab), indent=2, sort_keys=True) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (tokenizer_from / f).is_file():
            shutil.copy(tokenizer_from / f, out / f)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", type=Path, default=DEFAULT_OUT)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = write_checkpoint(args.output, args.seed)
    print(f"{out}: {(out / 'model.safetensors').stat().st_size / 1e9:.2f} GB", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
