"""The pieces every decoder layer shares, whatever the attention kind: `PagedKV` (where K/V live and the
two plugin calls that touch them), `StepMeta` (one forward's varlen metadata), `RMSNorm`, and the tensor-parallel
pieces every family uses: `row_parallel` (an output projection's partial products summed over the TP group) and the
vocab-parallel embedding lookup and logits.

They live apart from the GQA model (models/glm4_moe.py) so that the MLA attention (models/mla.py) and
other families use them without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

import plugins.collectives  # noqa: F401  (torch.ops.mtp.all_reduce)
from plugins.kv_pool import KVPoolGeometry
from plugins.rope import RopeTable, rope_table


@dataclass(frozen=True, slots=True)
class PagedKV:
    """Where K/V live: the pool address and geometry. One per forward; planes select the layer."""

    pool_ptr: torch.Tensor  # int64 [1] (CPU): address of the pool
    geom: KVPoolGeometry

    def write(self, plane: int, k, v, counts, starts, block_tables, rope_dim: int = 0, rope_theta: float = 0.0):
        g = self.geom
        return torch.ops.mtp.kv_write(
            k, v, counts, starts, block_tables, self.pool_ptr, plane,
            g.num_planes, g.num_blocks, g.block_size, g.num_kv_heads, g.head_dim, g.dtype_code,
            rope_dim, rope_theta,
        )  # fmt: skip

    def attend(self, plane: int, q, q_counts, kv_lens, block_tables, after, scale: float):
        g = self.geom
        return torch.ops.mtp.paged_attention(
            q, q_counts, kv_lens, block_tables, self.pool_ptr, after, plane,
            g.num_planes, g.num_blocks, g.block_size, g.num_kv_heads, g.head_dim, g.dtype_code, scale,
        )  # fmt: skip

    # MLA (kv_kind 1 pools: head_dim is the latent width; models/mla.py)
    def write_latent(self, plane: int, latent, counts, starts, block_tables, inv_freq, rope_dim: int = 0,
                     rope_scale: float = 1.0):  # fmt: skip
        g = self.geom
        return torch.ops.mtp.mla_kv_write(
            latent, counts, starts, block_tables, self.pool_ptr, inv_freq, plane,
            g.num_planes, g.num_blocks, g.block_size, g.head_dim, g.dtype_code, rope_dim, rope_scale,
        )  # fmt: skip

    def attend_latent(self, plane: int, q, q_counts, kv_lens, block_tables, after, rope_dim: int, scale: float):
        g = self.geom
        return torch.ops.mtp.mla_paged_attention(
            q, q_counts, kv_lens, block_tables, self.pool_ptr, after, plane,
            g.num_planes, g.num_blocks, g.block_size, g.head_dim, g.dtype_code, rope_dim, scale,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class StepMeta:
    """Per-forward varlen metadata (explicit forward arguments, hence named graph inputs).

    What every layer derives from it (write starts, RoPE tables) is computed once, by the first layer
    that asks, and kept in `derived` for the rest of this forward (so exported graphs compute it once too).
    """

    positions: torch.Tensor  # int64 [T] position of each packed row
    q_counts: torch.Tensor  # int32 [R] rows of each request in this forward (0 = padded request)
    kv_lens: torch.Tensor  # int32 [R] KV length of each request after this forward's write
    block_tables: torch.Tensor  # int32 [R, max_blocks]
    derived: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def write_starts(self) -> torch.Tensor:
        if "write_starts" not in self.derived:
            self.derived["write_starts"] = self.kv_lens - self.q_counts
        return self.derived["write_starts"]

    def rope(self, rope_dim: int, head_dim: int, theta: float, dtype: torch.dtype) -> RopeTable:
        key = ("rope", rope_dim, head_dim, theta, dtype)
        if key not in self.derived:
            self.derived[key] = rope_table(self.positions, rope_dim, head_dim, theta, dtype)
        return self.derived[key]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:  # one fused op, same formula
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def row_parallel(linear: nn.Linear, x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """`linear` over this rank's input columns (its heads): the partial products summed over the TP group by one
    all-reduce, the bias (replicated, models/sharding.py) added once after the sum. tp_size 1: the plain linear."""
    if tp_size == 1:
        return linear(x)
    out = torch.ops.mtp.all_reduce(F.linear(x, linear.weight), tp_size)
    return out if linear.bias is None else out + linear.bias


def vocab_parallel_embed(table: nn.Embedding, token_ids: torch.Tensor, vocab_lo: int, tp_size: int) -> torch.Tensor:
    """Token embeddings [N, H]; with TP each rank looks up its vocab rows [vocab_lo, ...) (others 0), then one
    all-reduce."""
    if tp_size == 1:
        return table(token_ids)
    local = token_ids - vocab_lo
    mine = (local >= 0) & (local < table.num_embeddings)
    rows = table(torch.where(mine, local, torch.zeros_like(local)))
    return torch.ops.mtp.all_reduce(rows * mine.unsqueeze(-1).to(rows.dtype), tp_size)


def vocab_parallel_logits(lm_head: nn.Linear, hidden: torch.Tensor, tp_size: int) -> torch.Tensor:
    """fp32 logits [N, V]; with TP every rank computes its vocab slice and all ranks gather the full row."""
    logits = lm_head(hidden).float()
    return torch.ops.mtp.all_gather(logits, tp_size) if tp_size > 1 else logits
