"""Triton kernels for the MLA latent paged KV (`mtp::mla_kv_write`, `mtp::mla_paged_attention`) and their launchers.

A sibling of plugins/triton_kernels.py (it reuses that module's request scan and input checks, and follows its
rules: no data-dependent host work, so launches are CUDA-graph capturable; tested on CPU under
`TRITON_INTERPRET=1`). Semantics: plugins/reference.py `mla_kv_write_ref` / `mla_paged_attention_ref`.

The pool is kv_kind 1: `[planes, 1, blocks, B, 1, latent_dim]`, one latent row `[k_pe ; c_kv]` per position.
Attention loads each latent tile once for a tile of BLOCK_HT query heads (all heads share the one latent
"KV head", which is MLA's point) and splits the key into its rope part and its c_kv part, so a 64 + 512
latent is not padded to 1024. With every tile dimension >= 16 the dot products are `tl.dot` in IEEE fp32;
smaller (test-sized) shapes use broadcast sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugins.kv_pool import KVPoolGeometry
from plugins.triton_kernels import _check_index, _flag, _pool_view, _request_of_row

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _mla_kv_write_kernel(
    latent_ptr, counts_ptr, starts_ptr, tables_ptr, pool_ptr, inv_freq_ptr, written_ptr,
    num_requests, max_blocks, plane, rope_scale, stride_row, stride_table,
    NUM_BLOCKS: tl.constexpr, BLOCK_SIZE: tl.constexpr, LATENT_DIM: tl.constexpr, ROPE_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    req, j = _request_of_row(counts_ptr, row, num_requests, BLOCK_R)
    live = _flag(req < num_requests)  # rows past sum(counts) are padding
    req_safe = tl.where(live, req, 0)
    pos = tl.load(starts_ptr + req_safe).to(tl.int64) + j
    col = pos // BLOCK_SIZE
    in_table = _flag(live & (col < max_blocks) & (col >= 0))
    block = tl.load(tables_ptr + req_safe * stride_table + tl.where(in_table, col, 0), mask=in_table, other=-1)
    block = block.to(tl.int64)
    valid = _flag(in_table & (block >= 0) & (block < NUM_BLOCKS))  # an id past the pool: never a wild write

    d = tl.arange(0, BLOCK_D)
    tile = valid & (d < LATENT_DIM)
    x = tl.load(latent_ptr + row * stride_row + d, mask=tile, other=0.0).to(tl.float32)
    if ROPE_DIM > 0:
        # neox rotate_half over the first ROPE_DIM dims with the model's inv_freq, cos/sin times rope_scale.
        half: tl.constexpr = ROPE_DIM // 2
        in_rope = d < ROPE_DIM
        partner_d = tl.where(d < half, d + half, d - half)
        partner = tl.load(latent_ptr + row * stride_row + partner_d, mask=tile & in_rope, other=0.0).to(tl.float32)
        inv_freq = tl.load(inv_freq_ptr + (d % half), mask=tile & in_rope, other=0.0).to(tl.float32)
        angle = pos.to(tl.float32) * inv_freq
        sign = tl.where(d < half, -1.0, 1.0)
        roped = (x * tl.cos(angle) + sign * partner * tl.sin(angle)) * rope_scale
        x = tl.where(in_rope, roped, x)
    base = ((plane * NUM_BLOCKS + block) * BLOCK_SIZE + pos % BLOCK_SIZE) * LATENT_DIM  # int64: pools are GBs
    tl.store(pool_ptr + base + d, x.to(pool_ptr.dtype.element_ty), mask=tile)
    tl.atomic_add(written_ptr, valid.to(tl.int64))


@triton.jit
def _scores(q, k, USE_DOT: tl.constexpr):
    """[HT, D] x [N, D] -> [HT, N] in fp32."""
    if USE_DOT:
        return tl.dot(q, tl.trans(k), input_precision="ieee")
    return tl.sum(q[:, None, :] * k[None, :, :], axis=2)


@triton.jit
def _weighted(p, v, USE_DOT: tl.constexpr):
    """[HT, N] x [N, V] -> [HT, V] in fp32."""
    if USE_DOT:
        return tl.dot(p, v, input_precision="ieee")
    return tl.sum(p[:, :, None] * v[None, :, :], axis=1)


@triton.jit
def _mla_attention_kernel(
    q_ptr, out_ptr, q_counts_ptr, kv_lens_ptr, tables_ptr, pool_ptr,
    num_requests, max_blocks, plane, scale, num_heads,
    stride_q_row, stride_q_head, stride_out_row, stride_out_head, stride_table,
    NUM_BLOCKS: tl.constexpr, BLOCK_SIZE: tl.constexpr, LATENT_DIM: tl.constexpr, ROPE_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_HT: tl.constexpr, BLOCK_PE: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_DOT: tl.constexpr,
):  # fmt: skip
    """One program = one query row x BLOCK_HT heads; online softmax over latent tiles of BLOCK_N positions."""
    VALUE_DIM: tl.constexpr = LATENT_DIM - ROPE_DIM
    row = tl.program_id(0).to(tl.int64)
    req, j = _request_of_row(q_counts_ptr, row, num_requests, BLOCK_R)
    live = _flag(req < num_requests)
    req_safe = tl.where(live, req, 0)
    n_q = tl.load(q_counts_ptr + req_safe).to(tl.int64)
    n_kv = tl.load(kv_lens_ptr + req_safe).to(tl.int64)
    last = tl.where(live, n_kv - n_q + j, -1)  # causal: this query sees positions 0..last

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
    for start in range(0, last + 1, BLOCK_N):
        pos = start + n
        seen = pos <= last
        block = tl.load(tables_ptr + req_safe * stride_table + pos // BLOCK_SIZE,
                        mask=seen & (pos // BLOCK_SIZE < max_blocks), other=-1).to(tl.int64)  # fmt: skip
        seen = seen & (block >= 0) & (block < NUM_BLOCKS)
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
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _weighted(p, c_kv, USE_DOT)
        m = m_new
    # Padded rows (and a request whose keys are all missing) come back as zeros, like the reference.
    result = tl.where(denom[:, None] > 0, acc / tl.where(denom > 0, denom, 1.0)[:, None], 0.0)
    out_mask = (h[:, None] < num_heads) & (dv[None, :] < VALUE_DIM)
    out_row = out_ptr + row * stride_out_row + h[:, None] * stride_out_head
    tl.store(out_row + dv[None, :], result.to(out_ptr.dtype.element_ty), mask=out_mask)


def _check_mla(geom: KVPoolGeometry, plane: int) -> None:
    if geom.kv_kind != 1:
        raise ValueError(f"MLA kernels need an MLA pool (kv_kind 1), got kv_kind {geom.kv_kind}")
    if not 0 <= plane < geom.num_planes:
        raise ValueError(f"plane {plane} outside 0..{geom.num_planes - 1}")


def _check_float(name: str, t: torch.Tensor, shape: str, device: torch.device) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: unsupported dtype {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: each {shape} row must be contiguous (strides {t.stride()})")


def mla_kv_write_triton(
    latent: torch.Tensor,
    counts: torch.Tensor,
    starts: torch.Tensor,
    block_tables: torch.Tensor,
    pool_ptr: int | torch.Tensor,
    inv_freq: torch.Tensor,
    plane: int,
    geom: KVPoolGeometry,
    rope_dim: int = 0,
    rope_scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the varlen latent write; returns int64[1] rows stored (on device, into `out` if given)."""
    device = latent.device
    _check_mla(geom, plane)
    if latent.dim() != 2 or latent.shape[1] != geom.head_dim:
        raise ValueError(f"latent: expected [T, {geom.head_dim}], got {tuple(latent.shape)}")
    _check_float("latent", latent, "[latent_dim]", device)
    for name, t in (("counts", counts), ("starts", starts)):
        _check_index(name, t, 1, device)
    _check_index("block_tables", block_tables, 2, device)
    if not (counts.shape[0] == starts.shape[0] == block_tables.shape[0]):
        raise ValueError("counts, starts and block_tables must have one entry per request")
    if rope_dim < 0 or rope_dim % 2 or rope_dim > geom.head_dim:
        raise ValueError(f"rope_dim {rope_dim} must be even and within latent_dim {geom.head_dim}")
    if rope_dim:
        if tuple(inv_freq.shape) != (rope_dim // 2,) or inv_freq.device != device:
            raise ValueError(f"inv_freq: expected [{rope_dim // 2}] on {device}, got {tuple(inv_freq.shape)} on "
                             f"{inv_freq.device}")  # fmt: skip
        _check_float("inv_freq", inv_freq, "", device)
    if out is None:
        out = torch.zeros(1, dtype=torch.int64, device=device)
    elif out.shape != (1,) or out.dtype != torch.int64 or out.device != device:
        raise ValueError("out must be an int64[1] tensor on latent's device")
    else:
        out.zero_()
    pool = _pool_view(pool_ptr, geom, device)
    if latent.shape[0] == 0:
        return out
    _mla_kv_write_kernel[(latent.shape[0],)](
        latent, counts, starts, block_tables, pool, inv_freq if rope_dim else latent, out,  # unread when rope is off
        counts.shape[0], block_tables.shape[1], plane, float(rope_scale), latent.stride(0), block_tables.stride(0),
        NUM_BLOCKS=geom.num_blocks, BLOCK_SIZE=geom.block_size, LATENT_DIM=geom.head_dim, ROPE_DIM=rope_dim,
        BLOCK_R=triton.next_power_of_2(max(counts.shape[0], 1)), BLOCK_D=triton.next_power_of_2(geom.head_dim),
    )  # fmt: skip
    return out


def mla_paged_attention_triton(
    q: torch.Tensor,
    q_counts: torch.Tensor,
    kv_lens: torch.Tensor,
    block_tables: torch.Tensor,
    pool_ptr: int | torch.Tensor,
    plane: int,
    geom: KVPoolGeometry,
    rope_dim: int,
    scale: float,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Launch absorbed MLA attention; returns [T, H, latent_dim - rope_dim] in q's dtype (padded rows zeros)."""
    device = q.device
    _check_mla(geom, plane)
    if q.dim() != 3 or q.shape[2] != geom.head_dim:
        raise ValueError(f"q: expected [T, H, {geom.head_dim}], got {tuple(q.shape)}")
    _check_float("q", q, "[latent_dim]", device)
    if not 0 <= rope_dim < geom.head_dim:
        raise ValueError(f"rope_dim {rope_dim} must be in [0, latent_dim {geom.head_dim})")
    for name, t in (("q_counts", q_counts), ("kv_lens", kv_lens)):
        _check_index(name, t, 1, device)
    _check_index("block_tables", block_tables, 2, device)
    if not (q_counts.shape[0] == kv_lens.shape[0] == block_tables.shape[0]):
        raise ValueError("q_counts, kv_lens and block_tables must have one entry per request")
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
    # A 512-wide c_kv tile of 32 positions plus the [16, 512] accumulator would not fit in registers: halve the tile.
    block_n = block_n or (16 if block_v >= 256 else 32)
    # tl.dot needs every tile dimension >= 16; the head tile is padded to 16 then (masked heads cost nothing wrong).
    use_dot = block_v >= 16 and (rope_dim == 0 or block_pe >= 16) and block_n >= 16 and heads >= 8
    block_ht = 16 if use_dot else min(triton.next_power_of_2(heads), 16)
    _mla_attention_kernel[(rows, triton.cdiv(heads, block_ht))](
        q, out, q_counts, kv_lens, block_tables, pool,
        q_counts.shape[0], block_tables.shape[1], plane, float(scale), heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        NUM_BLOCKS=geom.num_blocks, BLOCK_SIZE=geom.block_size, LATENT_DIM=geom.head_dim, ROPE_DIM=rope_dim,
        BLOCK_R=triton.next_power_of_2(max(q_counts.shape[0], 1)), BLOCK_HT=block_ht, BLOCK_PE=block_pe,
        BLOCK_V=block_v, BLOCK_N=block_n, USE_DOT=use_dot, num_warps=8 if block_v >= 256 else 4,
    )  # fmt: skip
    return out
