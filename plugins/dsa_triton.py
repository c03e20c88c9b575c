"""Triton kernels for DeepSeek Sparse Attention (`mtp::dsa_index_topk`, `mtp::dsa_sparse_attention`) and their launchers.

A sibling of plugins/mla_triton.py: the same MLA latent pool (kv_kind 1), the same rules (no data-dependent host work,
so launches are CUDA-graph capturable; tested on CPU under `TRITON_INTERPRET=1`, never yet on a GPU here).
Semantics: plugins/dsa_reference.py; the C++ CPU kernels (plugins/csrc/dsa_*.cpp) fix the order of the selection.

The top-k is two launches:
1. `_index_scores_kernel`, one program per (query row, tile of positions): the lightning indexer's score
   I(s) = sum_h w[h] * relu(scale * q[h] . k[s]) of every position of the row's block table into an fp32 scratch
   [T, max_blocks * block_size] (-inf where the row does not see the position). Sized from shapes, not from kv_lens,
   so the launch is capturable; DeepSeek's own indexer materialises the same logits.
2. `_topk_select_kernel`, one program per query row: an exact radix select over the scores' order-preserving int32
   keys (32 bisection passes over the row find the k-th largest key; equal floats have equal keys, and a row's exact
   zeros share one sign: all its weights negative or not), then one compaction pass in position order that
   keeps every key above it and the lowest positions among those equal to it. That is the C++ kernel's rule (higher
   score first, ties to the lower position) and its output order (ascending positions).

The sparse attention is mla_triton's absorbed attention with the positions read from `selected` instead of 0..last.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugins.kv_pool import KVPoolGeometry
from plugins.mla_triton import _check_float, _check_mla, _scores, _weighted
from plugins.triton_kernels import _check_index, _flag, _pool_view, _request_of_row


@triton.jit
def _row_sight(q_counts_ptr, kv_lens_ptr, row, num_requests, BLOCK_R: tl.constexpr):
    """(live, request, last): the request query row `row` belongs to (0 for a padding row, live False) and the last
    position it sees (causal: 0..last; -1 for a padding row)."""
    req, j = _request_of_row(q_counts_ptr, row, num_requests, BLOCK_R)
    live = _flag(req < num_requests)
    req_safe = tl.where(live, req, 0)
    n_q = tl.load(q_counts_ptr + req_safe).to(tl.int64)
    n_kv = tl.load(kv_lens_ptr + req_safe).to(tl.int64)
    return live, req_safe, tl.where(live, n_kv - n_q + j, -1)


@triton.jit
def _index_scores_kernel(
    q_ptr, w_ptr, q_counts_ptr, kv_lens_ptr, tables_ptr, pool_ptr, scores_ptr,
    num_requests, max_blocks, plane, scale, num_heads, dim,
    stride_q_row, stride_q_head, stride_w_row, stride_scores, stride_table,
    NUM_BLOCKS: tl.constexpr, BLOCK_SIZE: tl.constexpr, ROW_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_HI: tl.constexpr, BLOCK_DI: tl.constexpr, BLOCK_N: tl.constexpr, USE_DOT: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    live, req_safe, last = _row_sight(q_counts_ptr, kv_lens_ptr, row, num_requests, BLOCK_R)

    pos = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    seen = pos <= last
    block = tl.load(tables_ptr + req_safe * stride_table + pos // BLOCK_SIZE,
                    mask=seen & (pos // BLOCK_SIZE < max_blocks), other=-1).to(tl.int64)  # fmt: skip
    block = tl.where(block < 0, 0, block)  # a hole inside kv_len reads the null block, as the C++ kernel
    seen = seen & (block < NUM_BLOCKS)  # an id past the pool: never a wild read
    base = ((plane * NUM_BLOCKS + block) * BLOCK_SIZE + pos % BLOCK_SIZE) * ROW_DIM
    d = tl.arange(0, BLOCK_DI)
    keys = tl.load(pool_ptr + base[:, None] + d[None, :], mask=seen[:, None] & (d[None, :] < dim), other=0.0)
    h = tl.arange(0, BLOCK_HI)
    h_ok = (h < num_heads) & live
    q = tl.load(q_ptr + row * stride_q_row + h[:, None] * stride_q_head + d[None, :],
                mask=h_ok[:, None] & (d[None, :] < dim), other=0.0)  # fmt: skip
    w = tl.load(w_ptr + row * stride_w_row + h, mask=h_ok, other=0.0)
    per_head = tl.maximum(_scores(q, keys.to(tl.float32), USE_DOT) * scale, 0.0)  # [HI, N]
    score = tl.sum(w[:, None] * per_head, axis=0)
    score = tl.where(seen, score, float("-inf"))
    tl.store(scores_ptr + row * stride_scores + pos, score, mask=pos < max_blocks * BLOCK_SIZE)


@triton.jit
def _order_key(score):
    """fp32 -> int32 with the same order (flip the magnitude bits of negatives), as int64 for the bisection."""
    bits = score.to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def _topk_select_kernel(
    scores_ptr, out_ptr, q_counts_ptr, kv_lens_ptr, num_requests, topk, stride_scores, stride_out,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    _, _, last = _row_sight(q_counts_ptr, kv_lens_ptr, row, num_requests, BLOCK_R)
    visible = last + 1  # 0 for a padding row
    k = tl.minimum(visible, topk)
    n = tl.arange(0, BLOCK_N)
    src = scores_ptr + row * stride_scores

    # The k-th largest key: the largest t with count(key >= t) >= k, bisected over the int32 range.
    lo = visible * 0 - 2147483648
    hi = visible * 0 + 2147483647
    for _ in range(32):
        mid = lo + (hi - lo + 1) // 2
        count = visible * 0
        for start in range(0, visible, BLOCK_N):
            pos = start + n
            key = _order_key(tl.load(src + pos, mask=pos < visible, other=float("-inf")))
            count += tl.sum(((pos < visible) & (key >= mid)).to(tl.int64), axis=0)
        take = count >= k
        lo = tl.where(take, mid, lo)
        hi = tl.where(take, hi, mid - 1)
    above = visible * 0
    for start in range(0, visible, BLOCK_N):
        pos = start + n
        key = _order_key(tl.load(src + pos, mask=pos < visible, other=float("-inf")))
        above += tl.sum(((pos < visible) & (key > lo)).to(tl.int64), axis=0)
    ties_kept = k - above  # positions equal to the k-th key that fit, the lowest first

    # Compaction in position order: the output is ascending (the sparse attention's summation order).
    kept = visible * 0
    ties = visible * 0
    for start in range(0, visible, BLOCK_N):
        pos = start + n
        key = _order_key(tl.load(src + pos, mask=pos < visible, other=float("-inf")))
        tie = (pos < visible) & (key == lo)
        tie_rank = ties + tl.cumsum(tie.to(tl.int64), axis=0) - 1
        keep = ((pos < visible) & (key > lo)) | (tie & (tie_rank < ties_kept))
        slot = kept + tl.cumsum(keep.to(tl.int64), axis=0) - 1
        tl.store(out_ptr + row * stride_out + slot, pos, mask=keep)
        kept += tl.sum(keep.to(tl.int64), axis=0)
        ties += tl.sum(tie.to(tl.int64), axis=0)


@triton.jit
def _sparse_attention_kernel(
    q_ptr, out_ptr, q_counts_ptr, selected_ptr, tables_ptr, pool_ptr,
    num_requests, max_blocks, plane, scale, num_heads, topk,
    stride_q_row, stride_q_head, stride_out_row, stride_out_head, stride_sel, stride_table,
    NUM_BLOCKS: tl.constexpr, BLOCK_SIZE: tl.constexpr, LATENT_DIM: tl.constexpr, ROPE_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_HT: tl.constexpr, BLOCK_PE: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_DOT: tl.constexpr,
):  # fmt: skip
    """One program = one query row x BLOCK_HT heads; online softmax over tiles of BLOCK_N selected positions."""
    VALUE_DIM: tl.constexpr = LATENT_DIM - ROPE_DIM
    row = tl.program_id(0).to(tl.int64)
    req, _ = _request_of_row(q_counts_ptr, row, num_requests, BLOCK_R)
    live = _flag(req < num_requests)
    req_safe = tl.where(live, req, 0)

    h = tl.program_id(1) * BLOCK_HT + tl.arange(0, BLOCK_HT)
    h_ok = (h < num_heads) & live
    dv = tl.arange(0, BLOCK_V)
    dp = tl.arange(0, BLOCK_PE)
    q_row = q_ptr + row * stride_q_row + h[:, None] * stride_q_head
    q_c = tl.load(q_row + ROPE_DIM + dv[None, :], mask=h_ok[:, None] & (dv[None, :] < VALUE_DIM), other=0.0)
    q_c = q_c.to(tl.float32)
    q_pe = tl.load(q_row + dp[None, :], mask=h_ok[:, None] & (dp[None, :] < ROPE_DIM), other=0.0).to(tl.float32)

    m = tl.full([BLOCK_HT], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_HT], tl.float32)
    acc = tl.zeros([BLOCK_HT, BLOCK_V], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for start in range(0, tl.where(live, topk, 0), BLOCK_N):
        slot = start + n
        pos = tl.load(selected_ptr + row * stride_sel + slot, mask=slot < topk, other=-1).to(tl.int64)
        col = tl.where(pos >= 0, pos // BLOCK_SIZE, 0)
        block = tl.load(tables_ptr + req_safe * stride_table + col, mask=(pos >= 0) & (col < max_blocks),
                        other=-1).to(tl.int64)  # fmt: skip
        seen = (pos >= 0) & (block >= 0) & (block < NUM_BLOCKS)  # -1 = an unused slot
        base = ((plane * NUM_BLOCKS + block) * BLOCK_SIZE + pos % BLOCK_SIZE) * LATENT_DIM
        c_kv = tl.load(pool_ptr + base[:, None] + ROPE_DIM + dv[None, :],
                       mask=seen[:, None] & (dv[None, :] < VALUE_DIM), other=0.0).to(tl.float32)  # fmt: skip
        scores = _scores(q_c, c_kv, USE_DOT)
        if ROPE_DIM > 0:
            k_pe = tl.load(pool_ptr + base[:, None] + dp[None, :], mask=seen[:, None] & (dp[None, :] < ROPE_DIM),
                           other=0.0).to(tl.float32)  # fmt: skip
            scores += _scores(q_pe, k_pe, USE_DOT)
        scores = tl.where(seen[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile of unused slots only: no NaN from -inf - -inf
        alpha = tl.exp(m - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _weighted(p, c_kv, USE_DOT)
        m = m_new
    # Padded rows and rows with no selected position come back as zeros, like the reference.
    result = tl.where(denom[:, None] > 0, acc / tl.where(denom > 0, denom, 1.0)[:, None], 0.0)
    out_mask = (h[:, None] < num_heads) & (dv[None, :] < VALUE_DIM)
    out_row = out_ptr + row * stride_out_row + h[:, None] * stride_out_head
    tl.store(out_row + dv[None, :], result.to(out_ptr.dtype.element_ty), mask=out_mask)


def _check_requests(q_counts: torch.Tensor, block_tables: torch.Tensor, device: torch.device,
                    kv_lens: torch.Tensor | None = None) -> None:  # fmt: skip
    _check_index("q_counts", q_counts, 1, device)
    _check_index("block_tables", block_tables, 2, device)
    if kv_lens is not None:
        _check_index("kv_lens", kv_lens, 1, device)
    if q_counts.shape[0] != block_tables.shape[0] or (kv_lens is not None and kv_lens.shape[0] != q_counts.shape[0]):
        raise ValueError("q_counts, kv_lens and block_tables must have one entry per request")


def dsa_index_topk_triton(
    q: torch.Tensor,
    weights: torch.Tensor,
    q_counts: torch.Tensor,
    kv_lens: torch.Tensor,
    block_tables: torch.Tensor,
    pool_ptr: int | torch.Tensor,
    plane: int,
    geom: KVPoolGeometry,
    topk: int,
    scale: float,
    out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """Launch the indexer's selection: int64 [T, topk] positions per row, ascending, -1 = unused (into `out` if given).
    `scratch`: fp32 [T, max_blocks * block_size] for the scores (a TensorRT workspace); allocated when None."""
    device = q.device
    _check_mla(geom, plane)
    if q.dtype != torch.float32 or q.dim() != 3 or q.shape[2] > geom.head_dim:
        raise ValueError(f"q: expected float32 [T, heads, dim <= {geom.head_dim}], got {q.dtype} {tuple(q.shape)}; "
                         "the indexer scores in fp32: pass q.float()")  # fmt: skip
    if weights.dtype != torch.float32 or tuple(weights.shape) != tuple(q.shape[:2]):
        raise ValueError(f"weights: expected float32 [T, heads] = {list(q.shape[:2])}, got {weights.dtype} "
                         f"{tuple(weights.shape)}")  # fmt: skip
    _check_float("q", q, "[dim]", device)
    _check_float("weights", weights, "[heads]", device)
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    _check_requests(q_counts, block_tables, device, kv_lens)
    rows, heads, dim = q.shape
    width = block_tables.shape[1] * geom.block_size  # every position a block table can address
    if out is None:
        out = torch.empty(rows, topk, dtype=torch.int64, device=device)
    elif tuple(out.shape) != (rows, topk) or out.dtype != torch.int64 or out.device != device \
            or not out.is_contiguous():  # fmt: skip
        raise ValueError(f"out must be a contiguous int64 [{rows}, {topk}] tensor on {device}")
    if scratch is None:
        scratch = torch.empty(rows, width, dtype=torch.float32, device=device)
    elif scratch.dtype != torch.float32 or scratch.device != device or scratch.numel() < rows * width \
            or not scratch.is_contiguous():  # fmt: skip
        raise ValueError(f"scratch must be a contiguous float32 tensor of at least {rows} x {width} values on {device}")
    scores = scratch.reshape(-1)[: rows * width].view(rows, width)
    out.fill_(-1)
    pool = _pool_view(pool_ptr, geom, device)
    if rows == 0 or width == 0:
        return out
    block_hi, block_di = triton.next_power_of_2(heads), triton.next_power_of_2(dim)
    block_r = triton.next_power_of_2(max(q_counts.shape[0], 1))
    _index_scores_kernel[(rows, triton.cdiv(width, block_n))](
        q, weights, q_counts, kv_lens, block_tables, pool, scores,
        q_counts.shape[0], block_tables.shape[1], plane, float(scale), heads, dim,
        q.stride(0), q.stride(1), weights.stride(0), scores.stride(0), block_tables.stride(0),
        NUM_BLOCKS=geom.num_blocks, BLOCK_SIZE=geom.block_size, ROW_DIM=geom.head_dim, BLOCK_R=block_r,
        BLOCK_HI=block_hi, BLOCK_DI=block_di, BLOCK_N=block_n, USE_DOT=min(block_hi, block_di, block_n) >= 16,
    )  # fmt: skip
    _topk_select_kernel[(rows,)](
        scores, out, q_counts, kv_lens, q_counts.shape[0], topk, scores.stride(0), out.stride(0),
        BLOCK_R=block_r, BLOCK_N=1024,
    )  # fmt: skip
    return out


def dsa_sparse_attention_triton(
    q: torch.Tensor,
    q_counts: torch.Tensor,
    selected: torch.Tensor,
    block_tables: torch.Tensor,
    pool_ptr: int | torch.Tensor,
    plane: int,
    geom: KVPoolGeometry,
    rope_dim: int,
    scale: float,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Launch absorbed MLA attention over each row's selected positions; returns [T, H, latent_dim - rope_dim] in q's
    dtype (padded rows and rows selecting nothing are zeros)."""
    device = q.device
    _check_mla(geom, plane)
    if q.dim() != 3 or q.shape[2] != geom.head_dim:
        raise ValueError(f"q: expected [T, H, {geom.head_dim}], got {tuple(q.shape)}")
    _check_float("q", q, "[latent_dim]", device)
    if not 0 <= rope_dim < geom.head_dim:
        raise ValueError(f"rope_dim {rope_dim} must be in [0, latent_dim {geom.head_dim})")
    if selected.dtype != torch.int64 or selected.dim() != 2 or selected.shape[0] != q.shape[0] \
            or selected.device != device or selected.stride(-1) != 1:  # fmt: skip
        raise ValueError(f"selected: expected int64 [T={q.shape[0]}, topk] on {device} (a DsaIndexTopk output), got "
                         f"{selected.dtype} {tuple(selected.shape)} on {selected.device}")  # fmt: skip
    _check_requests(q_counts, block_tables, device)
    rows, heads = q.shape[0], q.shape[1]
    value_dim = geom.head_dim - rope_dim
    if out is None:
        out = torch.empty(rows, heads, value_dim, dtype=q.dtype, device=device)
    elif tuple(out.shape) != (rows, heads, value_dim) or out.dtype != q.dtype or out.device != device \
            or out.stride(-1) != 1:  # fmt: skip
        raise ValueError(f"out must be [{rows}, {heads}, {value_dim}] {q.dtype} on {device}, rows contiguous")
    pool = _pool_view(pool_ptr, geom, device)
    if rows == 0 or heads == 0:
        return out
    block_v = triton.next_power_of_2(value_dim)
    block_pe = triton.next_power_of_2(max(rope_dim, 1))
    block_n = block_n or (16 if block_v >= 256 else 32)  # as mla_triton: a 512-wide tile of 32 would spill
    use_dot = block_v >= 16 and (rope_dim == 0 or block_pe >= 16) and block_n >= 16 and heads >= 8
    block_ht = 16 if use_dot else min(triton.next_power_of_2(heads), 16)
    _sparse_attention_kernel[(rows, triton.cdiv(heads, block_ht))](
        q, out, q_counts, selected, block_tables, pool,
        q_counts.shape[0], block_tables.shape[1], plane, float(scale), heads, selected.shape[1],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), selected.stride(0), block_tables.stride(0),
        NUM_BLOCKS=geom.num_blocks, BLOCK_SIZE=geom.block_size, LATENT_DIM=geom.head_dim, ROPE_DIM=rope_dim,
        BLOCK_R=triton.next_power_of_2(max(q_counts.shape[0], 1)), BLOCK_HT=block_ht, BLOCK_PE=block_pe,
        BLOCK_V=block_v, BLOCK_N=block_n, USE_DOT=use_dot, num_warps=8 if block_v >= 256 else 4,
    )  # fmt: skip
    return out
