"""The MLA latent paged-KV ops: `mtp::mla_kv_write`, `mtp::mla_paged_attention`.

MLA (DeepSeek-V2/V3, GLM-4.7-Flash) caches one latent row per position, `[k_pe (rope_dim, roped) ; c_kv]`,
in a pool of kv_kind 1 (plugins/kv_pool.py). Attention runs in the absorbed form: the model folds W_UK into
the query (`[q_pe ; q_nope @ W_UK]` per head), so the keys are the whole latent and the values its c_kv part,
and W_UV is applied to the output by the model. Semantics: plugins/reference.py (`mla_*_ref`).

The same pattern as plugins/ops.py: schemas and CPU kernels in C++ (plugins/csrc/mla_*.cpp, loaded by
plugins/cpp_ops.py; the argument checks live there too), fake implementations for torch.export /
torch.compile and the CUDA (Triton) implementations here.
"""

from __future__ import annotations

import torch

import plugins.cpp_ops  # noqa: F401  (defines the mtp:: schemas and registers the C++ CPU kernels)
from plugins.kv_pool import KVPoolGeometry


def mla_geometry(num_planes: int, num_blocks: int, block_size: int, latent_dim: int, dtype: int) -> KVPoolGeometry:
    """The pool geometry an MLA node's attributes describe (one latent 'head' of latent_dim values)."""
    return KVPoolGeometry(num_planes, num_blocks, block_size, 1, latent_dim, dtype, kv_kind=1)


@torch.library.register_fake("mtp::mla_kv_write")
def _(latent, counts, starts, block_tables, pool_ptr, inv_freq, plane, num_planes, num_blocks, block_size,
      latent_dim, dtype, rope_dim, rope_scale):  # fmt: skip
    return torch.empty(1, dtype=torch.int64)


@torch.library.impl("mtp::mla_kv_write", "CUDA")
def _(latent, counts, starts, block_tables, pool_ptr, inv_freq, plane, num_planes, num_blocks, block_size,
      latent_dim, dtype, rope_dim, rope_scale):  # fmt: skip
    from plugins.mla_triton import mla_kv_write_triton

    geom = mla_geometry(num_planes, num_blocks, block_size, latent_dim, dtype)
    return mla_kv_write_triton(latent, counts, starts, block_tables, int(pool_ptr[0]), inv_freq, plane, geom,
                               rope_dim, rope_scale)  # fmt: skip


@torch.library.register_fake("mtp::mla_paged_attention")
def _(q, q_counts, kv_lens, block_tables, pool_ptr, after, plane, num_planes, num_blocks, block_size, latent_dim,
      dtype, rope_dim, scale):  # fmt: skip
    return q.new_empty(q.shape[0], q.shape[1], latent_dim - rope_dim)


@torch.library.impl("mtp::mla_paged_attention", "CUDA")
def _(q, q_counts, kv_lens, block_tables, pool_ptr, after, plane, num_planes, num_blocks, block_size, latent_dim,
      dtype, rope_dim, scale):  # fmt: skip
    from plugins.mla_triton import mla_paged_attention_triton

    geom = mla_geometry(num_planes, num_blocks, block_size, latent_dim, dtype)
    return mla_paged_attention_triton(q, q_counts, kv_lens, block_tables, int(pool_ptr[0]), plane, geom, rope_dim,
                                      scale)  # fmt: skip
