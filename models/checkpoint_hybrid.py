"""Import tables of the families beyond GLM-4.5 / DeepSeek-V3 (models/checkpoint.py merges them into LAYOUTS),
and which model class runs each `model_type`.

Each table is (regex over the checkpoint name, canonical name template, expert part) rows, as
models/checkpoint.py `Rule`; the first matching row wins and target "" ignores the tensor.
"""

from __future__ import annotations

from typing import cast

from models.config import ModelConfig
from models.glm4_moe import Glm4MoeMTPModel
from models.mimo import MiMoMTPModel
from models.mimo_v2 import MIMO_V2_RULES, MiMoV2MTPModel
from models.qwen3_next import Qwen3NextMTPModel

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


_HYBRID_BLOCK = (r"(input_layernorm|post_attention_layernorm|linear_attn\.(?:in_proj_[a-z]+|conv1d|out_proj|norm)"
                 r"|self_attn\.[a-z_]+|mlp\.(?:gate|[a-z]+_proj|shared_expert_gate|shared_expert\.[a-z]+_proj))")  # fmt: skip


def _hybrid_rules(trunk: str) -> tuple[tuple[str, str, str], ...]:
    """Qwen3-Next / Qwen3.5: trunk tensors under `trunk` (`model.`, or `model.language_model.` in the multimodal
    release), MTP at `mtp.*` (fc, pre_fc_norm_embedding / _hidden, layers.0 = one decoder layer, norm); routed experts
    per expert (`mlp.experts.{e}.gate_proj`...) or fused as transformers saves them (`mlp.experts.gate_up_proj`)."""
    rows: list[tuple[str, str, str]] = [
        (r"mtp\.(fc|pre_fc_norm_embedding|pre_fc_norm_hidden|norm)\.weight", r"mtp.0.\1.weight", ""),
        (r"model\.visual\..*", "", ""),  # the vision tower of the multimodal release: not imported
        (trunk + r"embed_tokens\.weight", "embed_tokens.weight", ""),
        (trunk + r"norm\.weight", "norm.weight", ""),
        (r"lm_head\.weight", "lm_head.weight", ""),
    ]
    for src, dst in ((r"mtp\.layers\.", r"mtp.\1.block."), (trunk + r"layers\.", r"layers.\1.")):
        rows += [
            (src + r"(\d+)\.mlp\.experts\.(\d+)\.gate_proj\.weight", dst + "mlp.w_gate_up", "gate"),
            (src + r"(\d+)\.mlp\.experts\.(\d+)\.up_proj\.weight", dst + "mlp.w_gate_up", "up"),
            (src + r"(\d+)\.mlp\.experts\.(\d+)\.down_proj\.weight", dst + "mlp.w_down", "down"),
            (src + r"(\d+)\.mlp\.experts\.gate_up_proj", dst + "mlp.w_gate_up", ""),
            (src + r"(\d+)\.mlp\.experts\.down_proj", dst + "mlp.w_down", ""),
            (src + r"(\d+)\.linear_attn\.(dt_bias|A_log)", dst + r"linear_attn.\2", ""),
            (src + r"(\d+)\." + _HYBRID_BLOCK + r"\.(weight|bias)", dst + r"\2.\3", ""),
        ]
    return tuple(rows)


HYBRID_LAYOUTS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "mimo": MIMO_RULES,
    "mimo_v2_flash": MIMO_V2_RULES,
    "qwen3_next": _hybrid_rules(r"model\."),
    "qwen3_5_moe_text": _hybrid_rules(r"model\."),
    "qwen3_5_moe": _hybrid_rules(r"model\.language_model\."),
    "qwen3_5_text": _hybrid_rules(r"model\."),
    "qwen3_5": _hybrid_rules(r"model\.language_model\."),
}
# One line each, logged by load_model (models/checkpoint.py plan notes).
LAYOUT_NOTES: dict[str, str] = {
    "qwen3_5_moe": "qwen3_5_moe: the vision tower (model.visual.*) is not imported; the engine serves the text model",
    "qwen3_5": "qwen3_5: the vision tower (model.visual.*) is not imported; the engine serves the text model",
}


def model_class(cfg: ModelConfig) -> type[Glm4MoeMTPModel]:
    """The nn.Module class that runs `cfg.model_type`. Every class has Glm4MoeMTPModel's attributes and three entry
    points; the hybrid one is not a subclass (its main forward takes a HybridCache), hence the cast."""
    if cfg.is_hybrid:
        return cast(type[Glm4MoeMTPModel], Qwen3NextMTPModel)
    if cfg.model_type == "mimo_v2_flash":
        return cast(type[Glm4MoeMTPModel], MiMoV2MTPModel)
    return MiMoMTPModel if cfg.model_type == "mimo" else Glm4MoeMTPModel
