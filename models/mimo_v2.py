"""MiMo-V2-Flash (`MiMoV2FlashForCausalLM`, `model_type: mimo_v2_flash`): a GLM-4.5-style MoE trunk mixing
sliding-window and full-attention layers, and THREE MTP modules, one per draft depth.

HF reference: transformers `MiMoV2FlashForCausalLM` (main model; it ignores `model.mtp.*`), vLLM's
`mimo_v2_flash_mtp.py` (the MTP layer's wiring and release names). What differs from models/glm4_moe.py:
  * attention (`MiMoV2Attention`): q/k head_dim != v_head_dim; values scaled by `attention_value_scale`; partial
    neox rope with a theta per layer kind; "sliding_attention" layers have 2x the KV heads, see the last
    `sliding_window` keys (the query included) and add a per-head sink logit to the softmax denominator
    (`mtp::swa_paged_attention`, plugins/swa_ops.py); "full_attention" layers are causal over every key.
    The KV pool is one geometry for all planes (models/config.py `kv_geometry_fields`): the sliding layers' KV heads
    and head_dim; a full layer stores each KV head repeated (GQA reads the same head), values zero-padded to
    head_dim (the padded output columns are dropped before o_proj).
  * MoE: the sigmoid router with correction bias (models/feed_forward.py `MoE`), no shared experts;
  * MTP module j (`model.mtp.layers.{j}.*`): eh_proj(cat[enorm(emb(t_{p+1})), hnorm(h_p)]) (embedding first), one
    sliding-window decoder layer with a dense MLP, final_layernorm, the shared lm_head; h is the main model's
    post-final-norm hidden and the chained hidden is the final_layernorm output (as models/glm4_moe.py).
Multi-module drafting (docs/MODELS.md "MiMo-V2-Flash"): depth d runs module d (the runtime picks it); module j
owns KV plane num_hidden_layers + j. The commit pass writes every module's plane, and a depth-d row also writes its
K/V into the planes of the modules after d (`forward_draft`), so that module d at depth d finds an entry at every
position it attends to (base-1 .. base-2+d are written by the earlier depths' rows).
"""

from __future__ import annotations

import functools
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

import plugins.swa_ops  # noqa: F401  (torch.ops.mtp.swa_paged_attention)
from models.config import ModelConfig, kv_geometry_fields
from models.feed_forward import MLP, MoE
from models.layers import PagedKV, RMSNorm, StepMeta
from plugins.mapping import Parallel, RankMapping, rank_mapping

# Import table (models/checkpoint_hybrid.py merges it; rows as models/checkpoint.py `Rule`). Main layers as transformers
# saves them or as released (`attention_sink_bias` = transformers' `sinks`; experts fused or per expert); MTP module
# j at `model.mtp.layers.{j}.*` as vLLM's mimo_v2_flash_mtp.py loads the release: enorm, hnorm, eh_proj,
# final_layernorm, and the decoder layer's tensors directly under it (`pre_mlp_layernorm` = post_attention_layernorm).
_ATTN = r"(input_layernorm|post_attention_layernorm|self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj|mlp\.gate)"
MIMO_V2_RULES: tuple[tuple[str, str, str], ...] = (
    (r"model\.mtp\.layers\.(\d+)\.(enorm|hnorm|eh_proj)\.weight", r"mtp.\1.\2.weight", ""),
    (r"model\.mtp\.layers\.(\d+)\.final_layernorm\.weight", r"mtp.\1.final_norm.weight", ""),
    (r"model\.mtp\.layers\.(\d+)\.self_attn\.(?:sinks|attention_sink_bias)", r"mtp.\1.block.self_attn.sinks", ""),
    (r"model\.mtp\.layers\.(\d+)\.pre_mlp_layernorm\.weight", r"mtp.\1.block.post_attention_layernorm.weight", ""),
    (r"model\.mtp\.layers\.(\d+)\." + _ATTN + r"\.(weight|bias)", r"mtp.\1.block.\2.\3", ""),
    (r"model\.embed_tokens\.weight", "embed_tokens.weight", ""),
    (r"model\.norm\.weight", "norm.weight", ""),
    (r"lm_head\.weight", "lm_head.weight", ""),
    (r"model\.layers\.(\d+)\.self_attn\.(?:sinks|attention_sink_bias)", r"layers.\1.self_attn.sinks", ""),
    (r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.gate_proj\.weight", r"layers.\1.mlp.w_gate_up", "gate"),
    (r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.up_proj\.weight", r"layers.\1.mlp.w_gate_up", "up"),
    (r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.down_proj\.weight", r"layers.\1.mlp.w_down", "down"),
    (r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj", r"layers.\1.mlp.w_gate_up", ""),
    (r"model\.layers\.(\d+)\.mlp\.experts\.down_proj", r"layers.\1.mlp.w_down", ""),
    (r"model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias", r"layers.\1.mlp.gate.e_score_correction_bias", ""),
    (r"model\.layers\.(\d+)\." + _ATTN + r"\.(weight|bias)", r"layers.\1.\2.\3", ""),
)


class MiMoV2Attention(nn.Module):
    """One attention layer over plane `plane`: sliding window + sinks, or full causal attention."""

    def __init__(self, cfg: ModelConfig, plane: int, sliding: bool) -> None:
        super().__init__()
        self.plane, self.sliding = plane, sliding
        self.num_heads, self.head_dim, self.v_head_dim = cfg.num_attention_heads, cfg.head_dim, cfg.v_head_dim
        self.num_kv_heads = cfg.swa_num_key_value_heads if sliding else cfg.num_key_value_heads
        pool_heads, _, _ = kv_geometry_fields(cfg)  # head_dim: v_head_dim <= head_dim (models/config_mimo_v2.py)
        self.repeat = pool_heads // self.num_kv_heads  # a full layer's KV heads, each stored this many times
        self.rope_dim, self.rope_theta = cfg.rotary_dim, cfg.swa_rope_theta if sliding else cfg.rope_theta
        self.window = cfg.sliding_window if sliding else 0
        self.scale, self.v_scale = cfg.head_dim**-0.5, cfg.attention_value_scale
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.v_head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, h, bias=False)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if sliding else None

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (not yet roped) and scaled V in the pool's layout: [T, pool KV heads, pool head dim]."""
        k = self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(-1, self.num_kv_heads, self.v_head_dim) * self.v_scale
        v = F.pad(v, (0, self.head_dim - self.v_head_dim))
        if self.repeat > 1:
            k, v = k.repeat_interleave(self.repeat, dim=1), v.repeat_interleave(self.repeat, dim=1)
        return k, v

    def forward(self, x: torch.Tensor, meta: StepMeta, kv: PagedKV, after: torch.Tensor | None = None) -> torch.Tensor:
        """after: other KV writes of this forward (a draft row's writes into later modules' planes) that the
        attention is ordered after; nothing reads those planes here, so without it an exported graph drops them."""
        q = self.q_proj(x).view(-1, self.num_heads, self.head_dim)
        k, v = self.project_kv(x)
        rope = meta.rope(self.rope_dim, self.head_dim, self.rope_theta, x.dtype)
        q, k = rope.apply(q), rope.apply(k)
        written = kv.write(self.plane, k, v, meta.q_counts, meta.write_starts, meta.block_tables)
        if after is not None:  # the plugin ops' `after` input is ordering only (never read): any combination will do
            written = torch.minimum(written, after)
        if self.sliding:
            g = kv.geom
            assert self.sinks is not None
            out = torch.ops.mtp.swa_paged_attention(
                q.contiguous(), meta.q_counts, meta.kv_lens, meta.block_tables, kv.pool_ptr, written,
                self.sinks.float(), self.plane, g.num_planes, g.num_blocks, g.block_size, g.num_kv_heads, g.head_dim,
                g.dtype_code, self.scale, self.window,
            )  # fmt: skip
        else:
            out = kv.attend(self.plane, q.contiguous(), meta.q_counts, meta.kv_lens, meta.block_tables, written,
                            self.scale)  # fmt: skip
        return self.o_proj(out[..., : self.v_head_dim].reshape(-1, self.num_heads * self.v_head_dim))

    def write_kv_only(self, x, counts, starts, block_tables, kv: PagedKV) -> torch.Tensor:
        """The commit pass: K/V of x, K roped at its write position inside the plugin."""
        k, v = self.project_kv(x)
        return kv.write(self.plane, k, v, counts, starts, block_tables, self.rope_dim, self.rope_theta)


class MiMoV2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, plane: int, sliding: bool, moe: bool, mapping: RankMapping) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MiMoV2Attention(cfg, plane, sliding)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = MoE(cfg, mapping=mapping) if moe else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, meta: StepMeta, kv: PagedKV, after: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), meta, kv, after)
        return x + self.mlp(self.post_attention_layernorm(x))


class MiMoV2MTPModule(nn.Module):
    """`model.mtp.layers.{j}`: eh_proj(cat[enorm(emb), hnorm(h)]) -> a sliding-window dense-MLP layer -> final_norm."""

    def __init__(self, cfg: ModelConfig, plane: int, mapping: RankMapping) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm, self.hnorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = MiMoV2DecoderLayer(cfg, plane, sliding=True, moe=False, mapping=mapping)
        self.final_norm = RMSNorm(h, eps)

    def fuse(self, token_emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(token_emb), self.hnorm(hidden)], dim=-1))

    def write_kv(self, token_emb, hidden, counts, starts, block_tables, kv: PagedKV) -> torch.Tensor:
        """This module's K/V of (hidden, token) rows only (the rest of its block does not run for them)."""
        x = self.block.input_layernorm(self.fuse(token_emb, hidden))
        return self.block.self_attn.write_kv_only(x, counts, starts, block_tables, kv)


class MiMoV2MTPModel(nn.Module):
    """Main model + lm_head + MTP modules, with Glm4MoeMTPModel's entry points. Planes: main layer i -> i, MTP
    module j -> num_hidden_layers + j."""

    def __init__(self, cfg: ModelConfig, ep_size: int = 1, mapping: RankMapping | None = None) -> None:
        super().__init__()
        m = mapping or rank_mapping(0, Parallel(ep_size, ep_size, 1), cfg.n_routed_experts)
        if m.tp > 1:
            raise ValueError(f"{cfg.model_type}: tensor parallelism is not supported; use tp_size 1")
        self.cfg, self.mapping = cfg, m
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([
            MiMoV2DecoderLayer(cfg, i, kind == "sliding_attention", cfg.is_moe_layer(i), m)
            for i, kind in enumerate(cfg.layer_types)
        ])  # fmt: skip
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleList(
            [MiMoV2MTPModule(cfg, cfg.num_hidden_layers + j, m) for j in range(cfg.num_mtp_modules)]
        )

    @property
    def num_kv_planes(self) -> int:
        return self.cfg.num_hidden_layers + self.cfg.num_mtp_modules

    def fuse(self) -> MiMoV2MTPModel:
        """Inference layout (idempotent): each dense MLP's gate|up as one GEMM."""
        for mod in self.modules():
            if isinstance(mod, MLP) and mod.gate_up is None:
                mod.fuse()
        return self

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(token_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def forward_main(self, input_ids: torch.Tensor, meta: StepMeta, kv: PagedKV) -> torch.Tensor:
        """input_ids [T] -> post-final-norm hidden [T, H]; K/V of every row appended to each layer's plane."""
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, meta, kv)
        return self.norm(x)

    def forward_draft(self, hidden, token_ids, positions, counts, block_tables, kv: PagedKV,
                      mtp_index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """One draft depth with module `mtp_index` -> (chained hidden after final_norm [R, H], logits [R, V]).

        The row's K/V also goes into the planes of the modules after `mtp_index` (their depths come later and
        attend to this position)."""
        module = cast(MiMoV2MTPModule, self.mtp[mtp_index])
        emb = self.embed(token_ids)
        later = [cast(MiMoV2MTPModule, m).write_kv(emb, hidden, counts, positions.to(counts.dtype), block_tables, kv)
                 for m in self.mtp[mtp_index + 1 :]]  # fmt: skip
        meta = StepMeta(positions.long(), counts, (positions.to(counts.dtype) + 1) * counts, block_tables)
        after = functools.reduce(torch.minimum, later) if later else None  # keeps those writes in exported graphs
        out = module.final_norm(module.block(module.fuse(emb, hidden), meta, kv, after))
        return out, self.compute_logits(out)

    def forward_commit(self, hidden, token_ids, counts, starts, block_tables, kv: PagedKV,
                       mtp_index: int = 0) -> torch.Tensor:  # fmt: skip
        """The commit pass: every module's K/V for the committed (h_p, t_{p+1}) rows; returns rows written (every
        module writes the same rows: their minimum, so that an exported graph's output depends on, and so keeps,
        every module's write). `mtp_index` is accepted for the common signature."""
        emb = self.embed(token_ids)
        written = [cast(MiMoV2MTPModule, mod).write_kv(emb, hidden, counts, starts, block_tables, kv)
                   for mod in self.mtp]  # fmt: skip
        return functools.reduce(torch.minimum, written)
