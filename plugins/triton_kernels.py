"""Triton kernels for the paged KV write and paged causal GQA attention, and their launchers.

This module owns the GPU implementations of `mtp::kv_write` and `mtp::paged_attention` (semantics:
plugins/reference.py). The same launchers run under the torch op (CUDA tensors), inside the TensorRT
plugins' `enqueue`, and on CPU under `TRITON_INTERPRET=1` (the tests).

Launchers do no data-dependent host work (no `.item()`, no sync, no size taken from tensor contents):
every block size comes from tensor *shapes*, and each program finds its own request by scanning the
per-request counts on device. That keeps them CUDA-graph capturable; under capture only the launched
kernels are replayed, so a host decision based on data would silently freeze.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugins.kv_pool import KVPoolGeometry, view_pool

_INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _flag(cond):
    """`cond` as a proper int1 scalar. Needed by Triton 3.9's interpreter only: it tags a scalar comparison with
    the operands' integer type, so broadcasting it into a tensor mask yields ints and `tl.load` rejects the mask."""
    return tl.where(cond, True, False)


@triton.jit
def _request_of_row(counts_ptr, row, num_requests, BLOCK_R: tl.constexpr):
    """(request index, row index inside the request) of packed row `row`; request == num_requests past the end.

    Done per program from the counts themselves (a cumsum over at most BLOCK_R requests) rather than from a
    host-built row map: no extra buffer, no host sync.
    """
    r = tl.arange(0, BLOCK_R)
    counts = tl.load(counts_ptr + r, mask=r < num_requests, other=0).to(tl.int64)
    ends = tl.cumsum(counts, axis=0)  # exclusive end row of each request
    req = tl.sum((ends <= row).to(tl.int64), axis=0)  # requests entirely before this row
    first = tl.sum(tl.where(r < req, counts, 0), axis=0)
    return req, row - first


@triton.jit
def _kv_write_kernel(
    k_ptr, v_ptr, counts_ptr, starts_ptr, tables_ptr, pool_ptr, written_ptr,
    num_requests, max_blocks, plane, rope_theta,
    stride_k_row, stride_v_row, stride_table,
    NUM_BLOCKS: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
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
    # A -1 block is a padded entry; an id past the pool is a caller bug, but never a wild write.
    valid = _flag(in_table & (block >= 0) & (block < NUM_BLOCKS))

    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    tile = valid & (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    key = tl.load(k_ptr + row * stride_k_row + h * HEAD_DIM + d, mask=tile, other=0.0).to(tl.float32)
    val = tl.load(v_ptr + row * stride_v_row + h * HEAD_DIM + d, mask=tile, other=0.0)
    if ROPE_DIM > 0:
        # neox rotate_half over the first ROPE_DIM dims (plugins/rope.py): x*cos + rotate_half(x)*sin.
        half: tl.constexpr = ROPE_DIM // 2
        in_rope = d < ROPE_DIM
        partner_d = tl.where(d < half, d + half, d - half)
        partner = tl.load(k_ptr + row * stride_k_row + h * HEAD_DIM + partner_d, mask=tile & in_rope, other=0.0)
        partner = partner.to(tl.float32)
        sign = tl.where(d < half, -1.0, 1.0)
        freq_idx = (d % half).to(tl.float32)
        inv_freq = tl.exp2(-(2.0 * freq_idx / ROPE_DIM) * tl.log2(rope_theta))
        angle = pos.to(tl.float32) * inv_freq
        roped = key * tl.cos(angle) + sign * partner * tl.sin(angle)
        key = tl.where(in_rope, roped, key)

    # int64 offsets: a production pool is many GB, past int32 element offsets.
    slot = pos % BLOCK_SIZE
    k_base = ((plane * 2 + 0) * NUM_BLOCKS + block) * BLOCK_SIZE + slot
    v_base = ((plane * 2 + 1) * NUM_BLOCKS + block) * BLOCK_SIZE + slot
    inner = h * HEAD_DIM + d
    elem = pool_ptr.dtype.element_ty
    tl.store(pool_ptr + k_base * (NUM_KV_HEADS * HEAD_DIM) + inner, key.to(elem), mask=tile)
    tl.store(pool_ptr + v_base * (NUM_KV_HEADS * HEAD_DIM) + inner, val.to(elem), mask=tile)
    tl.atomic_add(written_ptr, valid.to(tl.int64))


@triton.jit
def _paged_attention_kernel(
    q_ptr, out_ptr, q_counts_ptr, kv_lens_ptr, tables_ptr, pool_ptr,
    num_requests, max_blocks, plane, scale,
    stride_q_row, stride_out_row, stride_table, window, sinks_ptr,
    NUM_BLOCKS: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    """One program = one query row x one KV head (its GROUP query heads); online softmax over KV tiles.

    window > 0 (mtp::swa_paged_attention): only keys q_pos - window + 1 .. q_pos; HAS_SINKS: each query head's
    sink logit joins the softmax denominator (plugins/reference_swa.py)."""
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    req, j = _request_of_row(q_counts_ptr, row, num_requests, BLOCK_R)
    live = _flag(req < num_requests)
    req_safe = tl.where(live, req, 0)
    n_q = tl.load(q_counts_ptr + req_safe).to(tl.int64)
    n_kv = tl.load(kv_lens_ptr + req_safe).to(tl.int64)
    q_pos = n_kv - n_q + j  # causal: this query sees positions 0..q_pos
    last = tl.where(live, q_pos, -1)

    g = tl.arange(0, BLOCK_G)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    head = kv_head * GROUP + g
    q_tile = (g < GROUP) & (d < HEAD_DIM)
    q = tl.load(q_ptr + row * stride_q_row + head * HEAD_DIM + d, mask=q_tile & live, other=0.0).to(tl.float32)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    dk = tl.arange(0, BLOCK_D)
    row_elems = NUM_KV_HEADS * HEAD_DIM
    first = tl.where(window > 0, tl.maximum(q_pos - window + 1, 0), 0)  # the window's first key
    for start in range(first, last + 1, BLOCK_N):
        pos = start + n
        seen = (pos <= last) & (pos >= first)
        block = tl.load(tables_ptr + req_safe * stride_table + pos // BLOCK_SIZE,
                        mask=seen & (pos // BLOCK_SIZE < max_blocks), other=-1).to(tl.int64)  # fmt: skip
        seen = seen & (block >= 0) & (block < NUM_BLOCKS)
        slot = pos % BLOCK_SIZE
        k_base = (((plane * 2 + 0) * NUM_BLOCKS + block) * BLOCK_SIZE + slot) * row_elems + kv_head * HEAD_DIM
        v_base = (((plane * 2 + 1) * NUM_BLOCKS + block) * BLOCK_SIZE + slot) * row_elems + kv_head * HEAD_DIM
        kv_mask = seen[:, None] & (dk[None, :] < HEAD_DIM)
        keys = tl.load(pool_ptr + k_base[:, None] + dk[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        vals = tl.load(pool_ptr + v_base[:, None] + dk[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        # [G, 1, D] * [1, N, D] -> [G, N]: GROUP is often < 16, below tl.dot's minimum tile.
        scores = tl.sum(q[:, None, :] * keys[None, :, :], axis=2) * scale
        scores = tl.where(seen[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vals[None, :, :], axis=1)
        m = m_new
    if HAS_SINKS:  # the sink takes probability mass and adds no value
        sink = tl.load(sinks_ptr + kv_head * GROUP + tl.arange(0, BLOCK_G), mask=tl.arange(0, BLOCK_G) < GROUP,
                       other=float("-inf")).to(tl.float32)  # fmt: skip
        m_sink = tl.maximum(m, sink)
        alpha = tl.exp(m - m_sink)
        denom = denom * alpha + tl.exp(sink - m_sink)
        acc = acc * alpha[:, None]
    # Padded rows (and a request whose keys are all missing) come back as zeros, like the reference.
    result = tl.where(denom[:, None] > 0, acc / tl.where(denom > 0, denom, 1.0)[:, None], 0.0)
    tl.store(out_ptr + row * stride_out_row + head * HEAD_DIM + d, result.to(out_ptr.dtype.element_ty), mask=q_tile)


def _check_index(name: str, t: torch.Tensor, ndim: int, device: torch.device) -> None:
    if t.dtype not in _INDEX_DTYPES or t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D int32/int64 tensor, got {t.dtype} {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous")


def _check_rows(name: str, t: torch.Tensor, heads: int | None, geom: KVPoolGeometry) -> None:
    if t.dim() != 3 or t.shape[2] != geom.head_dim or (heads is not None and t.shape[1] != heads):
        raise ValueError(f"{name}: expected [T, {heads or 'H'}, {geom.head_dim}], got {tuple(t.shape)}")
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{name}: unsupported dtype {t.dtype}")
    if t.stride(2) != 1 or t.stride(1) != geom.head_dim:
        raise ValueError(f"{name}: each row [H, D] must be contiguous (strides {t.stride()})")


def _pool_view(pool_ptr: int | torch.Tensor, geom: KVPoolGeometry, device: torch.device) -> torch.Tensor:
    """The pool as a tensor: Triton wants a tensor argument; on CPU (interpreter) a ctypes-backed view."""
    if isinstance(pool_ptr, torch.Tensor):
        if tuple(pool_ptr.shape) != geom.shape or pool_ptr.dtype != geom.dtype or not pool_ptr.is_contiguous():
            raise ValueError(f"pool view {tuple(pool_ptr.shape)} {pool_ptr.dtype} does not match {geom}")
        return pool_ptr
    return view_pool(pool_ptr, geom, device)


def kv_write_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    counts: torch.Tensor,
    starts: torch.Tensor,
    block_tables: torch.Tensor,
    pool_ptr: int | torch.Tensor,
    plane: int,
    geom: KVPoolGeometry,
    rope_dim: int = 0,
    rope_theta: float = 10000.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the varlen paged KV write; returns int64[1] rows stored (computed on device, into `out` if given).

    `pool_ptr` is the pool's address (or, e.g. in tests, a contiguous tensor over it).
    """
    device = k.device
    _check_rows("k", k, geom.num_kv_heads, geom)
    _check_rows("v", v, geom.num_kv_heads, geom)
    if v.shape[0] != k.shape[0] or v.device != device:
        raise ValueError(f"k and v disagree: {tuple(k.shape)} on {k.device} vs {tuple(v.shape)} on {v.device}")
    for name, t in (("counts", counts), ("starts", starts)):
        _check_index(name, t, 1, device)
    _check_index("block_tables", block_tables, 2, device)
    if not (counts.shape[0] == starts.shape[0] == block_tables.shape[0]):
        raise ValueError("counts, starts and block_tables must have one entry per request")
    if not 0 <= plane < geom.num_planes:
        raise ValueError(f"plane {plane} outside 0..{geom.num_planes - 1}")
    if rope_dim < 0 or rope_dim % 2 or rope_dim > geom.head_dim:
        raise ValueError(f"rope_dim {rope_dim} must be even and within head_dim {geom.head_dim}")
    if out is None:
        out = torch.zeros(1, dtype=torch.int64, device=device)
    elif out.shape != (1,) or out.dtype != torch.int64 or out.device != device:
        raise ValueError("out must be an int64[1] tensor on k's device")
    else:
        out.zero_()
    pool = _pool_view(pool_ptr, geom, device)
    rows = k.shape[0]
    if rows == 0:
        return out
    _kv_write_kernel[(rows,)](
        k, v, counts, starts, block_tables, pool, out,
        counts.shape[0], block_tables.shape[1], plane, float(rope_theta),
        k.stride(0), v.stride(0), block_tables.stride(0),
        NUM_BLOCKS=geom.num_blocks, BLOCK_SIZE=geom.block_size, NUM_KV_HEADS=geom.num_kv_heads,
        HEAD_DIM=geom.head_dim, ROPE_DIM=rope_dim, BLOCK_R=triton.next_power_of_2(max(counts.shape[0], 1)),
        BLOCK_H=triton.next_power_of_2(geom.num_kv_heads), BLOCK_D=triton.next_power_of_2(geom.head_dim),
    )  # fmt: skip
    return out


def paged_attention_triton(
    q: torch.Tensor,
    q_counts: torch.Tensor,
    kv_lens: torch.Tensor,
    block_tables: torch.Tensor,
    pool_ptr: int | torch.Tensor,
    plane: int,
    geom: KVPoolGeometry,
    scale: float,
    out: torch.Tensor | None = None,
    block_n: int = 32,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch varlen paged causal GQA attention; returns [T, Hq, D] in q's dtype (padded rows are zeros).
    window > 0 / sinks [Hq] fp32: the sliding-window mode with sinks (mtp::swa_paged_attention)."""
    device = q.device
    _check_rows("q", q, None, geom)
    num_q_heads = q.shape[1]
    if num_q_heads % geom.num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads is not a multiple of {geom.num_kv_heads} KV heads")
    for name, t in (("q_counts", q_counts), ("kv_lens", kv_lens)):
        _check_index(name, t, 1, device)
    _check_index("block_tables", block_tables, 2, device)
    if not (q_counts.shape[0] == kv_lens.shape[0] == block_tables.shape[0]):
        raise ValueError("q_counts, kv_lens and block_tables must have one entry per request")
    if not 0 <= plane < geom.num_planes:
        raise ValueError(f"plane {plane} outside 0..{geom.num_planes - 1}")
    if sinks is not None and (sinks.dtype != torch.float32 or tuple(sinks.shape) != (num_q_heads,)):
        raise ValueError(f"sinks must be float32 [Hq={num_q_heads}], got {sinks.dtype} {tuple(sinks.shape)}")
    if window < 0:
        raise ValueError(f"window must be >= 0 (0 = no window), got {window}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != device or not out.is_contiguous():
        raise ValueError("out must be a contiguous tensor like q")
    pool = _pool_view(pool_ptr, geom, device)
    rows = q.shape[0]
    if rows == 0:
        return out
    group = num_q_heads // geom.num_kv_heads
    _paged_attention_kernel[(rows, geom.num_kv_heads)](
        q, out, q_counts, kv_lens, block_tables, pool,
        q_counts.shape[0], block_tables.shape[1], plane, float(scale),
        q.stride(0), out.stride(0), block_tables.stride(0), int(window), q if sinks is None else sinks.contiguous(),
        NUM_BLOCKS=geom.num_blocks, BLOCK_SIZE=geom.block_size, NUM_KV_HEADS=geom.num_kv_heads,
        HEAD_DIM=geom.head_dim, GROUP=group, BLOCK_R=triton.next_power_of_2(max(q_counts.shape[0], 1)),
        BLOCK_G=triton.next_power_of_2(group), BLOCK_D=triton.next_power_of_2(geom.head_dim), BLOCK_N=block_n,
        HAS_SINKS=sinks is not None,
    )  # fmt: skip
    return out
