"""Multi-head latent attention (MLA: DeepSeek-V2/V3, GLM-4.7-Flash `glm4_moe_lite`) over a latent paged KV pool.

HF reference: transformers `DeepseekV3Attention` (Glm4MoeLiteAttention is the same code). Per token the
pool holds ONE latent row `[k_pe (qk_rope_head_dim, roped) ; c_kv (kv_lora_rank, = kv_a_layernorm(...))]`
(docs/ARCHITECTURE.md, the MLA contract of plugins/mla_ops.py), not per-head K/V.

The paged path runs in the absorbed form: with kv_b_proj = per head [W_UK (nope rows) ; W_UV (v rows)]
over c_kv, q_nope . (W_UK c_kv) = (W_UK^T q_nope) . c_kv, so the query becomes `[q_pe ; q_nope @ W_UK]`
(latent_dim values per head), the keys are the whole latent and the values its c_kv part; W_UV maps the
latent-space output back per head before o_proj. `forward_train` decompresses (K/V per head, dense SDPA),
which is HF's own formulation and the cross-check of the absorbed one.

The checkpoint's interleaved rope rows (rope_interleave) are de-interleaved once at import
(models/checkpoint.py `deinterleave_rope_rows`), so the neox rope of plugins/rope.py applies here.

Tensor parallelism splits the attention heads (q_proj / q_b_proj and kv_b_proj rows, o_proj columns: models/sharding.py)
and replicates the latent path (q_a_proj, kv_a_proj_with_mqa, their norms): every rank writes the same latent rows
into its own pool and attends with its heads only; o_proj's partial sums meet in one all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import plugins.mla_ops  # noqa: F401  (registers torch.ops.mtp.mla_kv_write / mla_paged_attention)
from models.config import ModelConfig
from models.config import (
    kv_geometry_fields as kv_geometry_fields,  # re-exported: the pool geometry rule lives in config.py
)
from models.feed_forward import fuse_linears
from models.layers import PagedKV, RMSNorm, StepMeta, row_parallel
from plugins.rope import RopeTable, apply_rope_freq, rope_parameters, rope_table_freq, yarn_softmax_scale

# HF builds q_a_layernorm / kv_a_layernorm with the RMSNorm default eps, not config.rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def mla_rope(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq float32 [qk_rope_head_dim/2] on CPU, cos/sin scale) of an MLA model's (possibly YaRN) rope."""
    with torch.device("cpu"):  # also under a meta-device model construction: the table is not a weight
        return rope_parameters(
            cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_type, cfg.rope_factor, cfg.original_max_position_embeddings,
            cfg.beta_fast, cfg.beta_slow, cfg.rope_mscale, cfg.rope_mscale_all_dim, cfg.rope_attention_factor,
            cfg.rope_truncate,
        )  # fmt: skip


class MLAAttention(nn.Module):
    """Same interface as models/glm4_moe.py `Attention`: forward(x, meta, kv), write_kv_only(...), forward_train(x)."""

    def __init__(self, cfg: ModelConfig, plane: int, tp_size: int = 1) -> None:
        super().__init__()
        self.plane, self.tp_size = plane, tp_size
        self.num_heads = cfg.num_attention_heads // tp_size  # this rank's heads
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank, self.q_lora_rank = cfg.kv_lora_rank, cfg.q_lora_rank
        self.latent_dim = self.rope_dim + self.rank
        qk_head_dim = self.nope_dim + self.rope_dim
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(h, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(h, self.num_heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, h, bias=bias)
        self.inv_freq, self.rope_scale = mla_rope(cfg)  # plain CPU tensor: moved on use (_freqs)
        self.scale = yarn_softmax_scale(qk_head_dim, cfg.rope_type, cfg.rope_factor, cfg.rope_mscale_all_dim)
        self._rope_key = ("mla_rope", self.rope_dim, self.rope_scale, tuple(self.inv_freq.tolist()))
        # fuse(): one GEMM for the two projections of x, and W_UK / W_UV^T per head laid out for bmm, once
        self.qkv_a: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.absorbed: tuple[torch.Tensor, torch.Tensor] | None = None

    def fuse(self) -> None:
        """Inference only: precompute the absorbed per-head matrices and fuse [q_a | kv_a] (views keep the state_dict)."""
        q_in = self.q_a_proj if self.q_a_proj is not None else self.q_proj
        assert q_in is not None
        if (q_in.bias is None) == (self.kv_a_proj_with_mqa.bias is None):  # q_proj has no bias even with one on kv_a
            self.qkv_a = fuse_linears(q_in, self.kv_a_proj_with_mqa)
        w_uk, w_uv = self._split_kv_b()
        self.absorbed = (w_uk.detach().contiguous(), w_uv.detach().transpose(1, 2).contiguous())

    def _split_kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj.weight as W_UK [H, nope, rank] and W_UV [H, v, rank] (views)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def _freqs(self, device: torch.device) -> torch.Tensor:
        if self.inv_freq.device != device:
            self.inv_freq = self.inv_freq.to(device)
        return self.inv_freq

    def _project(self, x: torch.Tensor):
        """q_nope [T, H, nope], q_pe [T, H, rope] (not roped), c_kv [T, rank] (normed), k_pe [T, rope] (not roped)."""
        if self.qkv_a is not None:
            q_part, kv = F.linear(x, *self.qkv_a).split([self.qkv_a[0].shape[0] - self.rank - self.rope_dim,
                                                         self.rank + self.rope_dim], dim=-1)  # fmt: skip
        else:
            q_in = self.q_a_proj if self.q_a_proj is not None else self.q_proj
            assert q_in is not None
            q_part, kv = q_in(x), self.kv_a_proj_with_mqa(x)
        if self.q_b_proj is not None and self.q_a_layernorm is not None:
            q_part = self.q_b_proj(self.q_a_layernorm(q_part))
        q_nope, q_pe = q_part.view(-1, self.num_heads, self.nope_dim + self.rope_dim).split(
            [self.nope_dim, self.rope_dim], dim=-1
        )
        c_kv, k_pe = kv.split([self.rank, self.rope_dim], dim=-1)
        return q_nope, q_pe, self.kv_a_layernorm(c_kv), k_pe

    def _rope(self, meta: StepMeta, dtype: torch.dtype) -> RopeTable:
        key = (*self._rope_key, dtype)
        if key not in meta.derived:  # one table per forward for all MLA layers
            freqs = self._freqs(meta.positions.device)
            meta.derived[key] = rope_table_freq(meta.positions, freqs, self.rope_scale, self.rope_dim, dtype)
        return meta.derived[key]

    def forward(self, x: torch.Tensor, meta: StepMeta, kv: PagedKV) -> torch.Tensor:
        q_nope, q_pe, c_kv, k_pe = self._project(x)
        rope = self._rope(meta, x.dtype)
        latent = torch.cat([rope.apply(k_pe[:, None])[:, 0], c_kv], dim=-1)  # [T, latent_dim], k_pe first
        written = kv.write_latent(self.plane, latent, meta.q_counts, meta.write_starts, meta.block_tables,
                                  self._freqs(x.device))  # fmt: skip
        w_uk, w_uv_t = self.absorbed if self.absorbed is not None else self._unfused_absorbed()
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, rank] = q_nope @ W_UK per head
        q = torch.cat([rope.apply(q_pe), q_lat], dim=-1)
        o_lat = kv.attend_latent(self.plane, q, meta.q_counts, meta.kv_lens, meta.block_tables, written,
                                 self.rope_dim, self.scale)  # fmt: skip
        out = torch.bmm(o_lat.transpose(0, 1), w_uv_t).transpose(0, 1)  # [T, H, v] = W_UV o_lat per head
        return row_parallel(self.o_proj, out.reshape(-1, self.num_heads * self.v_dim), self.tp_size)

    def _unfused_absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        w_uk, w_uv = self._split_kv_b()
        return w_uk, w_uv.transpose(1, 2)

    def write_kv_only(self, x, counts, starts, block_tables, kv: PagedKV) -> torch.Tensor:
        """The commit pass: only kv_a_proj_with_mqa + kv_a_layernorm; k_pe roped at its write position in the op."""
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        latent = torch.cat([k_pe, self.kv_a_layernorm(c_kv)], dim=-1)
        return kv.write_latent(self.plane, latent, counts, starts, block_tables, self._freqs(x.device),
                               self.rope_dim, self.rope_scale)  # fmt: skip

    def forward_train(self, x: torch.Tensor) -> torch.Tensor:
        """Training path, decompressed as in HF: x [B, S, H] -> causal attention per sequence (autograd-able)."""
        b, s, _ = x.shape
        positions = torch.arange(s, device=x.device).repeat(b)
        q_nope, q_pe, c_kv, k_pe = self._project(x.reshape(b * s, -1))
        freqs = self._freqs(x.device)
        q_pe = apply_rope_freq(q_pe, positions, freqs, self.rope_scale)
        k_pe = apply_rope_freq(k_pe[:, None], positions, freqs, self.rope_scale)
        k_nope, v = self.kv_b_proj(c_kv).view(-1, self.num_heads, self.nope_dim + self.v_dim).split(
            [self.nope_dim, self.v_dim], dim=-1
        )
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, self.num_heads, -1)], dim=-1)
        q, k, v = (t.reshape(b, s, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))
