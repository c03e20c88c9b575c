"""DeepSeek Sparse Attention (DSA: DeepSeek-V3.2 `deepseek_v32`, GLM-5 `glm_moe_dsa`): MLA plus a lightning indexer.

HF reference: transformers `DeepseekV32Indexer` / `GlmMoeDsaIndexer` and their attention. Per layer the indexer has
its own small heads (index_n_heads x index_head_dim): a key per position, `k_norm(wk(x))` (a LayerNorm) roped on
its first qk_rope_head_dim dims, and per query row the queries `wq_b(q_resid)` (q_resid = q_a_layernorm(q_a_proj(x)),
the MLA query latent) and per-head weights `weights_proj(x) / sqrt(index_n_heads)`. Its score of a cached position s
for row t is sum_h w[t, h] relu(q[t, h] . k[s] / sqrt(index_head_dim)); the row attends (absorbed MLA, models/mla.py)
only to the `index_topk` best visible positions (plugins/dsa_ops.py: C++ kernels on CPU; the semantics in
plugins/dsa_reference.py). While a request has at most index_topk cached positions every visible one
is selected: the layer is dense attention, and a forward whose requests are all that short runs the MLA
paged-attention op without scoring; the sparse kernel gives such a request's rows the same bits (selection in
ascending order, the dense kernel's summation order), so the switch never depends on the batch.

The indexer keys are cached in the paged pool beside the latent KV: a DSA model's pool has twice the planes, the
indexer-key plane of the layer owning latent plane p is p + num_attention_planes (models/config.py num_kv_planes),
and a key fills the first index_head_dim values of its row (the rest stay zero). The MTP layer is a DSAAttention
too, with its own indexer and its own key plane: the draft scores its own keys (never the main model's top-k), and
the commit pass (`write_kv_only`) writes its indexer keys as well as its latent rows.

The indexer rope: DeepSeek-V3.2 rotates halves (neox, as plugins/rope.py); GLM-5 rotates interleaved pairs, which
is neox on the even-then-odd reordering of those dims (what transformers' apply_rotary_pos_emb_interleave computes;
the same reordering of q and k leaves every dot product unchanged). The indexer weights are imported as stored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig, num_kv_planes
from models.config_dsa import INTERLEAVED_INDEXER_ROPE
from models.layers import PagedKV, StepMeta
from models.mla import MLAAttention, mla_rope
from plugins.dsa_ops import index_topk, sparse_attention
from plugins.rope import apply_rope_freq

INDEXER_NORM_EPS = 1e-6  # transformers builds the indexer's k_norm LayerNorm with eps 1e-6


class Indexer(nn.Module):
    """The lightning indexer of one layer (checkpoint names `self_attn.indexer.{wq_b,wk,k_norm,weights_proj}`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=INDEXER_NORM_EPS)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        self.scale = self.head_dim**-0.5
        # GLM-5: interleaved pairs -> neox halves (the first rope_dim dims of q and k, both the same way)
        r = self.rope_dim
        with torch.device("cpu"):  # also under a meta-device model construction: not a weight
            order = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2), torch.arange(r, self.head_dim)])
        self.order = order if cfg.model_type in INTERLEAVED_INDEXER_ROPE else None
        self.inv_freq, self.rope_scale = mla_rope(cfg)  # the MLA rope's frequencies and YaRN factor

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] -> roped on the first rope_dim dims (after GLM-5's pair reordering)."""
        if self.order is not None:
            x = x.index_select(-1, self.order.to(x.device))
        if self.inv_freq.device != x.device:
            self.inv_freq = self.inv_freq.to(x.device)
        return apply_rope_freq(x, positions, self.inv_freq, self.rope_scale)

    def keys(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Roped indexer keys [T, head_dim] of rows x at `positions`."""
        return self._rope(self.k_norm(self.wk(x))[:, None], positions)[:, 0]

    def queries(self, x: torch.Tensor, q_resid: torch.Tensor, positions: torch.Tensor):
        """Roped queries [T, heads, head_dim] and per-head weights [T, heads] (fp32, as transformers scores)."""
        q = self._rope(self.wq_b(q_resid).view(-1, self.n_heads, self.head_dim), positions)
        return q, self.weights_proj(x).float() * self.n_heads**-0.5


def _positions(counts: torch.Tensor, starts: torch.Tensor, rows: int) -> torch.Tensor:
    """Position of each of `rows` packed rows of segments (counts, starts): starts[r] + 0..counts[r]-1, then 0 for
    padding rows past sum(counts) (the write skips them). Tensor ops only, no data-dependent size: it is traced into
    the commit graph of an engine."""
    counts, starts = counts.long(), starts.long()
    ends = torch.cumsum(counts, 0)
    row = torch.arange(rows, device=counts.device)
    seg = (row[:, None] >= ends[None, :]).sum(-1).clamp(max=counts.shape[0] - 1)  # the segment holding each row
    pos = starts[seg] + row - (ends - counts)[seg]
    return torch.where(row < ends[-1:], pos, torch.zeros_like(pos))


def _zero(written: torch.Tensor) -> torch.Tensor:
    """0 computed from `written` (rows stored: >= 0), in a form no graph compiler can fold to a constant (Inductor
    folds `t * 0`), so the data dependency on the write survives."""
    return written.clamp(max=0)


def _after(x: torch.Tensor, written: torch.Tensor) -> torch.Tensor:
    """x, made to depend on `written` (a pool write's output): the DSA ops have no `after` input, and a graph runs a
    node reading the pool after the write it needs only through a data dependency (adding 0 keeps x's values)."""
    return x + _zero(written).to(x.dtype).reshape(1, *([1] * (x.dim() - 1)))


class DSAAttention(MLAAttention):
    """MLA attention whose rows attend to their indexer's top-k positions; same interface as MLAAttention."""

    def __init__(self, cfg: ModelConfig, plane: int) -> None:
        super().__init__(cfg, plane)
        # GLM-5 "shared" main layers have no indexer: they reuse the last full layer's top-k of this forward (kept in
        # StepMeta.derived). The MTP layer (plane >= num_hidden_layers) always runs its own.
        self.shares_topk = cfg.index_pattern[plane : plane + 1] == "S"
        self.indexer: Indexer | None = None if self.shares_topk else Indexer(cfg)
        self.index_plane = plane + num_kv_planes(cfg) // 2  # this layer's indexer-key plane (unused when shared)
        self.index_topk = cfg.index_topk

    def _project_dsa(self, x: torch.Tensor):
        """As MLAAttention._project, plus the query latent q_resid the indexer reads (q_lora_rank > 0 for DSA)."""
        assert self.q_a_layernorm is not None and self.q_b_proj is not None and self.q_a_proj is not None
        if self.qkv_a is not None:
            q_a, kv = F.linear(x, *self.qkv_a).split([self.q_lora_rank, self.rank + self.rope_dim], dim=-1)
        else:
            q_a, kv = self.q_a_proj(x), self.kv_a_proj_with_mqa(x)
        q_resid = self.q_a_layernorm(q_a)
        q_nope, q_pe = self.q_b_proj(q_resid).view(-1, self.num_heads, self.nope_dim + self.rope_dim).split(
            [self.nope_dim, self.rope_dim], dim=-1
        )
        c_kv, k_pe = kv.split([self.rank, self.rope_dim], dim=-1)
        return q_nope, q_pe, self.kv_a_layernorm(c_kv), k_pe, q_resid

    def _write_keys(self, x, positions, counts, starts, block_tables, kv: PagedKV) -> torch.Tensor | None:
        """The indexer keys written into this layer's indexer-key plane: the write's output (None: shared layer)."""
        if self.indexer is None:
            return None
        keys = self.indexer.keys(x, positions)
        row = F.pad(keys, (0, self.latent_dim - keys.shape[-1]))  # the key in the first index_head_dim values
        return kv.write_latent(self.index_plane, row, counts, starts, block_tables, self._freqs(x.device))

    def forward(self, x: torch.Tensor, meta: StepMeta, kv: PagedKV) -> torch.Tensor:
        q_nope, q_pe, c_kv, k_pe, q_resid = self._project_dsa(x)
        rope = self._rope(meta, x.dtype)
        latent = torch.cat([rope.apply(k_pe[:, None])[:, 0], c_kv], dim=-1)
        written = kv.write_latent(self.plane, latent, meta.q_counts, meta.write_starts, meta.block_tables,
                                  self._freqs(x.device))  # fmt: skip
        keys_written = self._write_keys(x, meta.positions, meta.q_counts, meta.write_starts, meta.block_tables, kv)
        w_uk, w_uv_t = self.absorbed if self.absorbed is not None else self._unfused_absorbed()
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        q = torch.cat([rope.apply(q_pe), q_lat], dim=-1)
        # Every visible position selected: dense attention. A traced graph (an engine) cannot branch on the lengths;
        # it always runs the sparse ops, which give such rows the same bits.
        if not torch.compiler.is_compiling() and int(meta.kv_lens.max()) <= self.index_topk:
            o_lat = kv.attend_latent(self.plane, q, meta.q_counts, meta.kv_lens, meta.block_tables, written,
                                     self.rope_dim, self.scale)  # fmt: skip
        else:
            if keys_written is not None:
                written = written + keys_written  # the indexer reads the keys just written
            # both DSA ops read what this layer just wrote: their inputs depend on the writes (_after)
            o_lat = self.sparse_attention(x, _after(q, written), _after(q_resid, written), meta, kv)
        out = torch.bmm(o_lat.transpose(0, 1), w_uv_t).transpose(0, 1)
        return self.o_proj(out.reshape(-1, self.num_heads * self.v_dim))

    def select(self, x: torch.Tensor, q_resid: torch.Tensor, meta: StepMeta, kv: PagedKV) -> torch.Tensor:
        """int64 [T, index_topk]: the positions each row attends to (its indexer's top-k, or the last full layer's
        for a shared layer; -1 = unused slot)."""
        if self.indexer is None:
            return meta.derived["dsa_topk"]
        q_idx, weights = self.indexer.queries(x, q_resid, meta.positions)
        selected = index_topk(kv.pool_ptr, kv.geom, q_idx, weights, meta.q_counts, meta.kv_lens, meta.block_tables,
                              self.index_plane, self.index_topk, self.indexer.scale)  # fmt: skip
        meta.derived["dsa_topk"] = selected  # for the shared layers after this one
        return selected

    def sparse_attention(self, x, q, q_resid, meta: StepMeta, kv: PagedKV) -> torch.Tensor:
        selected = self.select(x, q_resid, meta, kv)
        return sparse_attention(kv.pool_ptr, kv.geom, q, meta.q_counts, meta.block_tables, selected, self.plane,
                                self.rope_dim, self.scale)  # fmt: skip

    def write_kv_only(self, x, counts, starts, block_tables, kv: PagedKV) -> torch.Tensor:
        """The commit pass: the latent rows (MLAAttention) and this layer's own indexer keys at the same positions."""
        written = super().write_kv_only(x, counts, starts, block_tables, kv)
        keys = self._write_keys(x, _positions(counts, starts, x.shape[0]).to(x.device), counts, starts, block_tables, kv)
        # rows written = the latent write's count; the keys' write joins the output so no graph optimizer drops it
        return written if keys is None else written + _zero(keys)

    def forward_train(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("forward_train (dense training attention) is not implemented for sparse-attention (DSA) "
                         "models; train an MLA model (deepseek_v3) instead")  # fmt: skip
