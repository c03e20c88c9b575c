"""Import tables of the families beyond GLM-4.5 / DeepSeek-V3 (models/checkpoint.py merges them into LAYOUTS),
and which model class runs each `model_type`.

Each table is (regex over the checkpoint name, canonical name template, expert part) rows, as
models/checkpoint.py `Rule`; the first matching row wins and target "" ignores the tensor.
"""

from __future__ import annotations

from models.config import ModelConfig
from models.glm4_moe import Glm4MoeMTPModel
from models.mimo import MiMoMTPModel

_QWEN2_BLOCK = r"(input_layernorm|post_attention_layernorm|self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)"

# MiMo-7B (`MiMoForCausalLM`): a Qwen2 trunk; MTP layer j at model.mtp_layers.{j}.* with its own names for the
# GLM parts (token_layernorm = enorm, hidden_layernorm = hnorm, input_proj = eh_proj, final_layernorm = the
# shared_head.norm) and the decoder block's tensors directly under it (no `mtp_block.` prefix in the release).
MIMO_RULES: tuple[tuple[str, str, str], ...] = (
    (r"model\.mtp_layers\.(\d+)\.token_layernorm\.weight", r"mtp.\1.enorm.weight", ""),
    (r"model\.mtp_layers\.(\d+)\.hidden_layernorm\.weight", r"mtp.\1.hnorm.weight", ""),
    (r"model\.mtp_layers\.(\d+)\.input_proj\.weight", r"mtp.\1.eh_proj.weight", ""),
    (r"model\.mtp_layers\.(\d+)\.final_layernorm\.weight", r"mtp.\1.final_norm.weight", ""),
    (r"model\.mtp_layers\.(\d+)\." + _QWEN2_BLOCK + r"\.(weight|bias)", r"mtp.\1.block.\2.\3", ""),
    (r"model\.embed_tokens\.weight", "embed_tokens.weight", ""),
    (r"model\.norm\.weight", "norm.weight", ""),
    (r"lm_head\.weight", "lm_head.weight", ""),
    (r"model\.layers\.(\d+)\." + _QWEN2_BLOCK + r"\.(weight|bias)", r"layers.\1.\2.\3", ""),
)

HYBRID_LAYOUTS: dict[str, tuple[tuple[str, str, str], ...]] = {"mimo": MIMO_RULES}


def model_class(cfg: ModelConfig) -> type[Glm4MoeMTPModel]:
    """The nn.Module class that runs `cfg.model_type` (every class has Glm4MoeMTPModel's three entry points)."""
    return MiMoMTPModel if cfg.model_type == "mimo" else Glm4MoeMTPModel
