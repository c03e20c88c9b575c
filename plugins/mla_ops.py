"""torch.library custom ops for MLA's latent paged KV: `mtp::mla_kv_write`, `mtp::mla_paged_attention`.

MLA (DeepSeek-V2/V3, GLM-4.7-Flash) caches one latent row per position, `[k_pe (rope_dim, roped) ; c_kv]`,
in a pool of kv_kind 1 (plugins/kv_pool.py). Attention runs in the absorbed form: the model folds W_UK into
the query (`[q_pe ; q_nope @ W_UK]` per head), so the keys are the whole latent and the values its c_kv part,
and W_UV is applied to the output by the model. Semantics: plugins/reference.py (`mla_*_ref`).

The same pattern as plugins/ops.py: pool by address plus geometry ints, CPU implementations vectorized over
the step plans of plugins/step_plan.py (the "K plane" is the latent, the "V plane" latent[..., rope_dim:]),
CUDA inputs to the Triton kernels, fake implementations for torch.export.
"""

from __future__ import annotations

import torch

from plugins.kv_pool import KVPoolGeometry, plane_kv
from plugins.step_plan import AttentionPlan, cached, plan_attention, plan_write


def mla_geometry(num_planes: int, num_blocks: int, block_size: int, latent_dim: int, dtype: int) -> KVPoolGeometry:
    """The pool geometry an MLA node's attributes describe (one latent 'head' of latent_dim values)."""
    return KVPoolGeometry(num_planes, num_blocks, block_size, 1, latent_dim, dtype, kv_kind=1)


def rope_with_freqs(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, rope_dim: int,
                    rope_scale: float) -> torch.Tensor:  # fmt: skip
    """x [T, D] float: neox rotate_half over x[:, :rope_dim] at `positions`, cos/sin scaled by rope_scale (YaRN)."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos() * rope_scale, emb.sin() * rope_scale
    half = rope_dim // 2
    rot = x[:, :rope_dim]
    rotated = torch.cat([-rot[:, half:], rot[:, :half]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, x[:, rope_dim:]], dim=-1)


def _check_rope(rope_dim: int, latent_dim: int, inv_freq: torch.Tensor) -> None:
    if rope_dim < 0 or rope_dim % 2 or rope_dim > latent_dim:
        raise ValueError(f"mla_kv_write: rope_dim {rope_dim} must be even and within latent_dim {latent_dim}")
    if rope_dim and tuple(inv_freq.shape) != (rope_dim // 2,):
        raise ValueError(f"mla_kv_write: inv_freq has shape {tuple(inv_freq.shape)}, rope_dim {rope_dim} needs "
                         f"[{rope_dim // 2}]")  # fmt: skip


@torch.library.custom_op("mtp::mla_kv_write", mutates_args=())
def mla_kv_write(
    latent: torch.Tensor,
    counts: torch.Tensor,
    starts: torch.Tensor,
    block_tables: torch.Tensor,
    pool_ptr: torch.Tensor,
    inv_freq: torch.Tensor,
    plane: int,
    num_planes: int,
    num_blocks: int,
    block_size: int,
    latent_dim: int,
    dtype: int,
    rope_dim: int,
    rope_scale: float,
) -> torch.Tensor:
    geom = mla_geometry(num_planes, num_blocks, block_size, latent_dim, dtype)
    if latent.dim() != 2 or latent.shape[1] != latent_dim:
        raise ValueError(f"mla_kv_write: latent must be [T, {latent_dim}], got {tuple(latent.shape)}")
    _check_rope(rope_dim, latent_dim, inv_freq)
    if latent.device.type == "cuda":
        from plugins.mla_triton import mla_kv_write_triton

        return mla_kv_write_triton(latent, counts, starts, block_tables, int(pool_ptr[0]), inv_freq, plane, geom,
                                   rope_dim, rope_scale)  # fmt: skip
    return mla_kv_write_cpu(plane_kv(int(pool_ptr[0]), geom, plane)[0], latent, counts, starts, block_tables,
                            block_size, inv_freq, rope_dim, rope_scale)  # fmt: skip


def mla_kv_write_cpu(
    latent_plane: torch.Tensor,  # one plane's latent rows, [blocks * B, 1, latent_dim]
    latent: torch.Tensor,  # [T, latent_dim]
    counts: torch.Tensor,
    starts: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    inv_freq: torch.Tensor,
    rope_dim: int,
    rope_scale: float,
) -> torch.Tensor:
    """One `index_copy_` into the plane at the slots planned once per forward (the GQA write's plan)."""
    plan = cached("write", lambda: plan_write(counts, starts, block_tables, block_size), (block_size,),
                  counts, starts, block_tables)  # fmt: skip
    if plan.total > latent.shape[0]:
        raise ValueError(f"mla_kv_write: segments hold {plan.total} rows but only {latent.shape[0]} latent rows "
                         "were given")  # fmt: skip
    rows = latent[: plan.written] if plan.rows is None else latent[plan.rows]
    if rope_dim > 0:
        rows = rope_with_freqs(rows.float(), plan.positions, inv_freq, rope_dim, rope_scale)
    latent_plane.index_copy_(0, plan.slots, rows.to(latent_plane.dtype)[:, None, :])
    return torch.tensor([plan.written], dtype=torch.int64)


@mla_kv_write.register_fake
def _(latent, counts, starts, block_tables, pool_ptr, inv_freq, plane, num_planes, num_blocks, block_size,
      latent_dim, dtype, rope_dim, rope_scale):  # fmt: skip
    return torch.empty(1, dtype=torch.int64)


@torch.library.custom_op("mtp::mla_paged_attention", mutates_args=())
def mla_paged_attention(
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
    latent_dim: int,
    dtype: int,
    rope_dim: int,
    scale: float,
) -> torch.Tensor:
    geom = mla_geometry(num_planes, num_blocks, block_size, latent_dim, dtype)
    if q.dim() != 3 or q.shape[2] != latent_dim:
        raise ValueError(f"mla_paged_attention: q must be [T, H, {latent_dim}], got {tuple(q.shape)}")
    if not 0 <= rope_dim < latent_dim:
        raise ValueError(f"mla_paged_attention: rope_dim {rope_dim} must be in [0, latent_dim {latent_dim})")
    if q.device.type == "cuda":
        from plugins.mla_triton import mla_paged_attention_triton

        return mla_paged_attention_triton(q, q_counts, kv_lens, block_tables, int(pool_ptr[0]), plane, geom,
                                          rope_dim, scale)  # fmt: skip
    plan = cached("attend", lambda: plan_attention(q_counts, kv_lens, block_tables, block_size, q.shape[0]),
                  (block_size, q.shape[0]), q_counts, kv_lens, block_tables)  # fmt: skip
    return mla_paged_attention_cpu(plane_kv(int(pool_ptr[0]), geom, plane)[0], q, plan, rope_dim, scale)


def mla_paged_attention_cpu(
    latent_plane: torch.Tensor,  # one plane's latent rows, [blocks * B, 1, latent_dim]
    q: torch.Tensor,  # [T, H, latent_dim] absorbed queries packed by request
    plan: AttentionPlan,
    rope_dim: int,
    scale: float,
) -> torch.Tensor:
    """All requests at once, one masked SDPA in fp32 with the H heads folded into the query axis.

    There is one latent "KV head" for all H query heads, so [R, 1, Qmax*H, D] queries against [R, 1, Lmax, D]
    keys is the whole attention with no per-head copy of the keys (enable_gqa would expand them H times).
    """
    t, heads, _ = q.shape
    value_dim = latent_plane.shape[2] - rope_dim
    if t == 0 or plan.q_max == 0:
        return q.new_zeros(t, heads, value_dim)
    r, q_max, kv_max = plan.num_requests, plan.q_max, plan.kv_max
    keys = latent_plane.index_select(0, plan.gather).view(r, 1, kv_max, -1).float()
    queries = q if plan.q_rows is None else q.index_select(0, plan.q_rows)
    mask = plan.mask
    if mask is not None:  # [R, 1, Qmax, Lmax] -> one row per (query, head), heads innermost like the queries
        mask = mask[:, :, :, None, :].expand(r, 1, q_max, heads, kv_max).reshape(r, 1, q_max * heads, kv_max)
    attn = torch.nn.functional.scaled_dot_product_attention(
        queries.reshape(r, 1, q_max * heads, -1).float(), keys, keys[..., rope_dim:], attn_mask=mask, scale=scale
    ).reshape(r * q_max, heads, value_dim)
    if plan.out_rows is None or plan.out_slots is None:
        return attn.to(q.dtype)
    out = q.new_zeros(t, heads, value_dim)
    out.index_copy_(0, plan.out_rows, attn.index_select(0, plan.out_slots).to(q.dtype))
    return out


@mla_paged_attention.register_fake
def _(q, q_counts, kv_lens, block_tables, pool_ptr, after, plane, num_planes, num_blocks, block_size, latent_dim,
      dtype, rope_dim, scale):  # fmt: skip
    return q.new_empty(q.shape[0], q.shape[1], latent_dim - rope_dim)
