"""torch.library custom ops the model calls: `mtp::kv_write`, `mtp::paged_attention`, `mtp::moe_experts`.

The KV pool travels by address (int64[1]) plus geometry ints, exactly as the plugin nodes in the exported
graphs do (plugins/kv_pool.py says why). CPU implementations are vectorized PyTorch equivalent to
plugins/reference.py; CUDA inputs go to the Triton kernels. Fake implementations let torch.export trace
the ops so plugins/onnx_export.py can map them to plugin-namespace nodes.

kv_write returns a 1-element int64 tensor (rows stored); paged_attention takes it as `after` so the
read is ordered after the write in every graph (nothing else ties them together: the pool is not a
tensor the graph sees).
"""

from __future__ import annotations

import torch

from plugins.kv_pool import KVPoolGeometry, view_pool
from plugins.rope import apply_rope


def segment_rows(counts: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Expand (count, start) segments into per-row (request index, position), rows packed by request."""
    counts = counts.long()
    req = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts)
    first_row = torch.cumsum(counts, 0) - counts
    pos = starts.long()[req] + torch.arange(req.shape[0], device=counts.device) - first_row[req]
    return req, pos


def _geometry(num_planes: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: int):
    return KVPoolGeometry(num_planes, num_blocks, block_size, num_kv_heads, head_dim, dtype)


@torch.library.custom_op("mtp::kv_write", mutates_args=())
def kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    counts: torch.Tensor,
    starts: torch.Tensor,
    block_tables: torch.Tensor,
    pool_ptr: torch.Tensor,
    plane: int,
    num_planes: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: int,
    rope_dim: int,
    rope_theta: float,
) -> torch.Tensor:
    geom = _geometry(num_planes, num_blocks, block_size, num_kv_heads, head_dim, dtype)
    if k.device.type == "cuda":
        from plugins.triton_kernels import kv_write_triton

        return kv_write_triton(k, v, counts, starts, block_tables, int(pool_ptr[0]), plane, geom, rope_dim, rope_theta)
    pool = view_pool(int(pool_ptr[0]), geom)
    req, pos = segment_rows(counts, starts)
    n = req.shape[0]
    if n > k.shape[0]:
        raise ValueError(f"kv_write: segments hold {n} rows but only {k.shape[0]} K/V rows were given")
    col = pos // block_size
    in_table = col < block_tables.shape[1]
    block = torch.full_like(pos, -1)
    block[in_table] = block_tables[req[in_table], col[in_table]].long()
    valid = block >= 0
    keys = k[:n]
    if rope_dim > 0:
        keys = apply_rope(keys.float(), pos, rope_dim, rope_theta)
    block, slot = block[valid], (pos % block_size)[valid]
    pool[plane, 0, block, slot] = keys[valid].to(pool.dtype)
    pool[plane, 1, block, slot] = v[:n][valid].to(pool.dtype)
    return torch.tensor([int(valid.sum())], dtype=torch.int64)


@kv_write.register_fake
def _(k, v, counts, starts, block_tables, pool_ptr, plane, num_planes, num_blocks, block_size, num_kv_heads,
      head_dim, dtype, rope_dim, rope_theta):  # fmt: skip
    return torch.empty(1, dtype=torch.int64)


@torch.library.custom_op("mtp::paged_attention", mutates_args=())
def paged_attention(
    q: torch.Tensor,
    q_counts: torch.Tensor,
    kv_lens: torch.Tensor,
    block_tables: torch.Tensor,
    pool_ptr: torch.Tensor,
    after: torch.Tensor,
    plane: int,
    num_planes: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: int,
    scale: float,
) -> torch.Tensor:
    geom = _geometry(num_planes, num_blocks, block_size, num_kv_heads, head_dim, dtype)
    if q.device.type == "cuda":
        from plugins.triton_kernels import paged_attention_triton

        return paged_attention_triton(q, q_counts, kv_lens, block_tables, int(pool_ptr[0]), plane, geom, scale)
    pool = view_pool(int(pool_ptr[0]), geom)
    return paged_attention_cpu(pool[plane], q, q_counts, kv_lens, block_tables, scale)


def paged_attention_cpu(
    plane: torch.Tensor,  # [2, blocks, B, Hkv, D] one KV plane of the pool
    q: torch.Tensor,  # [T, Hq, D] packed by request
    q_counts: torch.Tensor,  # [R]
    kv_lens: torch.Tensor,  # [R]
    block_tables: torch.Tensor,  # [R, max_blocks]
    scale: float,
) -> torch.Tensor:
    """All requests at once: pad queries to [R, Qmax] and keys to [R, Lmax], one batched masked SDPA.

    Padded query rows, padded requests (q_count 0) and positions past a request's kv_len are masked
    out and never written back, so they read nothing that matters and produce zeros.
    """
    out = torch.zeros_like(q)
    qc, kl = q_counts.long(), kv_lens.long()
    if q.shape[0] == 0 or int(qc.max()) == 0:
        return out
    block_size = plane.shape[2]
    q_max, kv_max = int(qc.max()), int(kl.max())
    pos = torch.arange(kv_max)
    kv_valid = pos[None, :] < kl[:, None]  # [R, Lmax]
    blocks = torch.where(kv_valid, block_tables[:, pos // block_size].long(), 0).clamp(min=0)
    keys = plane[0][blocks, pos % block_size]  # [R, Lmax, Hkv, D]
    values = plane[1][blocks, pos % block_size]
    j = torch.arange(q_max)
    q_valid = j[None, :] < qc[:, None]  # [R, Qmax]
    rows = torch.where(q_valid, (torch.cumsum(qc, 0) - qc)[:, None] + j[None, :], 0)
    q_pos = (kl - qc)[:, None] + j[None, :]  # position of each query
    mask = (pos[None, None, :] <= q_pos[:, :, None]) & kv_valid[:, None, :]  # [R, Qmax, Lmax]
    mask |= ~q_valid[:, :, None]  # padded query rows see everything (their output is discarded): no NaN rows
    mask[:, :, 0] |= kv_valid.sum(1)[:, None] == 0  # padded requests: one dummy column, output discarded
    attn = torch.nn.functional.scaled_dot_product_attention(
        q[rows].transpose(1, 2).float(),  # [R, Hq, Qmax, D]
        keys.transpose(1, 2).float(),  # [R, Hkv, Lmax, D]
        values.transpose(1, 2).float(),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=True,
    ).transpose(1, 2)  # [R, Qmax, Hq, D]
    out[rows[q_valid]] = attn[q_valid].to(q.dtype)
    return out


@paged_attention.register_fake
def _(q, q_counts, kv_lens, block_tables, pool_ptr, after, plane, num_planes, num_blocks, block_size, num_kv_heads,
      head_dim, dtype, scale):  # fmt: skip
    return torch.empty_like(q)


@torch.library.custom_op("mtp::moe_experts", mutates_args=())
def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    num_experts: int,
    ep_size: int,
) -> torch.Tensor:
    """Routed experts. ep_size > 1: this rank holds experts [rank*E/ep, (rank+1)*E/ep) and exchanges tokens."""
    if ep_size > 1:
        from plugins.moe_ep import moe_experts_ep

        return moe_experts_ep(x, topk_ids, topk_weights, w_gate_up, w_down, num_experts, ep_size)
    return moe_experts_local(x, topk_ids, topk_weights, w_gate_up, w_down, expert_offset=0)


@moe_experts.register_fake
def _(x, topk_ids, topk_weights, w_gate_up, w_down, num_experts, ep_size):
    return torch.empty_like(x)


def moe_experts_local(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    expert_offset: int,
) -> torch.Tensor:
    """Grouped-by-expert computation over the experts held locally (global ids offset..offset+E_local-1)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = w_gate_up.shape[1] // 2
    local = topk_ids - expert_offset
    for e in torch.unique(local).tolist():  # only the experts some token picked (decode: a handful)
        if not 0 <= e < w_gate_up.shape[0]:
            continue  # held by another rank
        tok, slot = torch.nonzero(local == e, as_tuple=True)
        gate_up = x[tok].float() @ w_gate_up[e].float().t()
        h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = (h @ w_down[e].float().t()) * topk_weights[tok, slot].float()[:, None]
        out.index_add_(0, tok, y)
    return out.to(x.dtype)
