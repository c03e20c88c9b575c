"""Tiny random MiMo-V2-Flash checkpoints for tests (no model hub), beside models/testing.py's other families.

The main model is transformers' own `MiMoV2FlashForCausalLM.save_pretrained`; the MTP modules, which transformers
neither builds nor loads, are written at `model.mtp.layers.{j}.*` in the release's names (vLLM's
mimo_v2_flash_mtp.py): a sliding-window, dense-MLP `MiMoV2FlashDecoderLayer` built by transformers (its
`self_attn.sinks` saved as `attention_sink_bias`, its `post_attention_layernorm` as `pre_mlp_layernorm`), plus
enorm, hnorm, eh_proj [H, 2H] and final_layernorm.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from models.testing import _randomize

# 3 layers: full, sliding, sliding (layer 0 dense, then MoE); window 8 so short prompts cross it. head_dim 12 with
# partial_rotary_factor 0.334 ropes 4 dims, as the release ropes 64 of 192.
MIMO_V2_BASE = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=1, head_dim=12, v_head_dim=8, sliding_window=8, moe_intermediate_size=16,
    n_routed_experts=4, num_experts_per_tok=2, max_position_embeddings=512, rms_norm_eps=1e-6,
    layer_types=["full_attention", "sliding_attention", "sliding_attention"],
    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 50000.0, "partial_rotary_factor": 0.334},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 0.334}},
    attention_value_scale=0.707, eos_token_id=None, bos_token_id=None, tie_word_embeddings=False,
)  # fmt: skip


def make_mimo_v2_checkpoint(path: str | Path, seed: int = 0, num_mtp: int = 3, **overrides) -> dict:
    """A tiny random MiMo-V2-Flash checkpoint with `num_mtp` MTP modules. Returns the HF config dict."""
    import transformers
    from transformers.models.mimo_v2_flash.modeling_mimo_v2_flash import MiMoV2FlashDecoderLayer

    hf_cfg = transformers.MiMoV2FlashConfig(**{**MIMO_V2_BASE, **overrides})
    g = torch.Generator().manual_seed(seed)
    model = transformers.MiMoV2FlashForCausalLM(hf_cfg).eval()
    _randomize(model, g)
    path = Path(path)
    model.save_pretrained(str(path))
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    mtp_cfg = copy.deepcopy(hf_cfg)
    mtp_cfg.num_hidden_layers, mtp_cfg.layer_types, mtp_cfg.mlp_layer_types = 1, ["sliding_attention"], ["dense"]
    h = hf_cfg.hidden_size
    for j in range(num_mtp):
        block = MiMoV2FlashDecoderLayer(mtp_cfg, 0).eval()
        _randomize(block, g)
        prefix = f"model.mtp.layers.{j}."
        for name, t in block.state_dict().items():
            name = name.replace("self_attn.sinks", "self_attn.attention_sink_bias")
            tensors[prefix + name.replace("post_attention_layernorm", "pre_mlp_layernorm")] = t.clone()
        for norm in ("enorm", "hnorm", "final_layernorm"):
            tensors[f"{prefix}{norm}.weight"] = 1.0 + 0.1 * torch.randn(h, generator=g)
        tensors[f"{prefix}eh_proj.weight"] = 0.1 * torch.randn(h, 2 * h, generator=g)
    save_file(tensors, str(file), metadata={"format": "pt"})
    hf = json.loads((path / "config.json").read_text())
    hf["num_nextn_predict_layers"] = num_mtp
    (path / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return hf
