"""Tiny random DeepSeek-V3.2 / GLM-5 (DeepSeek Sparse Attention) checkpoints, written by transformers itself.

Like models/testing.py `make_mla_checkpoint`, with the indexer of every layer and of the MTP module. index_topk is
small (8) so that a test context of a few dozen tokens crosses it: below it the layers are dense, past it sparse.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from models.testing import MLA_BASE, YARN, _mtp_tensors, _randomize

DSA_BASE = {**{k: v for k, v in MLA_BASE.items() if k != "rope_interleave"}, "index_n_heads": 8, "index_head_dim": 12,
            "index_topk": 8}  # fmt: skip
# The parity variants (tests/models/test_dsa_parity.py, tests/runtime/test_dsa_lossless.py): model_type + overrides.
DSA_VARIANTS: dict[str, tuple[str, dict]] = {
    "dsv32": ("deepseek_v32", dict(n_group=4, topk_group=2, rope_parameters=YARN)),  # neox indexer rope, YaRN
    # interleaved indexer rope; layer 1 "shared" (no indexer: reuses layer 0's top-k), layer 2 runs its own again
    "glm5": ("glm_moe_dsa", dict(num_hidden_layers=3, indexer_types=["full", "shared", "full"])),
}


def make_dsa_checkpoint(path: str | Path, model_type: str = "deepseek_v32", seed: int = 0, **overrides) -> dict:
    """A tiny random DSA checkpoint saved by transformers' save_pretrained, plus the MTP module (its own indexer
    included) at model.layers.{L}.* as the released checkpoints store it. Returns the HF config dict."""
    import transformers
    from safetensors.torch import load_file, save_file

    kw: dict[str, Any] = {**DSA_BASE, **overrides}
    kw.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})
    k = kw["first_k_dense_replace"]
    kw["mlp_layer_types"] = ["dense"] * k + ["sparse"] * (kw["num_hidden_layers"] - k)
    classes = {"deepseek_v32": (transformers.DeepseekV32Config, transformers.DeepseekV32ForCausalLM),
               "glm_moe_dsa": (transformers.GlmMoeDsaConfig, transformers.GlmMoeDsaForCausalLM)}  # fmt: skip
    config_cls, model_cls = classes[model_type]
    hf_cfg = config_cls(**kw)
    g = torch.Generator().manual_seed(seed)
    model = model_cls(hf_cfg).eval()
    _randomize(model, g)
    path = Path(path)
    model.save_pretrained(str(path))
    num_mtp = kw["num_nextn_predict_layers"]
    if num_mtp:
        file = path / "model.safetensors"
        tensors = load_file(str(file))
        for j in range(num_mtp):  # "glm4_moe_lite": the block's MoE is chosen by mlp_layer_types, as in these models
            tensors.update(_mtp_tensors(model, hf_cfg, "glm4_moe_lite", hf_cfg.num_hidden_layers + j, g))
        save_file(tensors, str(file), metadata={"format": "pt"})
    return json.loads((path / "config.json").read_text())
