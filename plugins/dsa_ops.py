"""DeepSeek Sparse Attention over the paged latent pool: the indexer's top-k selection and the sparse attention.

On CPU the C++ kernels run (plugins/csrc/dsa_*.cpp): the plugin ops `mtp::dsa_index_topk` /
`mtp::dsa_sparse_attention`, specified in plugins/op_spec.py, hence ONNX nodes (DsaIndexTopk, DsaSparseAttention),
ONNX Runtime ops and opaque calls in the compiled packages. On CUDA the same torch ops (and so the model's wrappers
below) run the Triton kernels (plugins/dsa_triton.py, which the TensorRT plugins of plugins/_trt_impl.py launch too);
both are tested under TRITON_INTERPRET=1 only: no GPU has run them (docs/MODELS.md, DSA limits). On any other
device, implementations in vectorised PyTorch, one request at a time (the semantics, position by position, are
plugins/dsa_reference.py; tests/plugins/test_dsa_ops.py holds these to them), reading the pool through a view at its
address (plugins/kv_pool.py `view_pool`).

Per request r with n_kv cached positions and n_q query rows (the last n_q positions), row j sees positions
0..n_kv-n_q+j. The gather of a request's rows goes through its block table once per call.
"""

from __future__ import annotations

import torch

import plugins.cpp_ops  # noqa: F401  (loads the C++ library: the mtp::dsa_* schemas and CPU kernels)
from plugins.kv_pool import KVPoolGeometry, view_pool
from plugins.mla_ops import mla_geometry
from plugins.op_backends import define_torch
from plugins.op_spec import SPECS

for _op in ("dsa_index_topk", "dsa_sparse_attention"):
    define_torch(SPECS[_op])  # the C++ library's schema checked against the spec; the fake from its shape rule


@torch.library.impl("mtp::dsa_index_topk", "CUDA")
def _(q, weights, q_counts, kv_lens, block_tables, pool_ptr, plane, num_planes, num_blocks, block_size, row_dim,
      dtype, topk, scale):  # fmt: skip
    from plugins.dsa_triton import dsa_index_topk_triton

    geom = mla_geometry(num_planes, num_blocks, block_size, row_dim, dtype)
    return dsa_index_topk_triton(q, weights, q_counts, kv_lens, block_tables, int(pool_ptr[0]), plane, geom, topk,
                                 scale)  # fmt: skip


@torch.library.impl("mtp::dsa_sparse_attention", "CUDA")
def _(q, q_counts, selected, block_tables, pool_ptr, plane, num_planes, num_blocks, block_size, latent_dim, dtype,
      rope_dim, scale):  # fmt: skip
    from plugins.dsa_triton import dsa_sparse_attention_triton

    geom = mla_geometry(num_planes, num_blocks, block_size, latent_dim, dtype)
    return dsa_sparse_attention_triton(q, q_counts, selected, block_tables, int(pool_ptr[0]), plane, geom, rope_dim,
                                       scale)  # fmt: skip


# Where the plugin ops have kernels (CPU: C++, CUDA: Triton); elsewhere the vectorised PyTorch below runs.
_PLUGIN_DEVICES = ("cpu", "cuda")


def sparse_attention(pool_ptr: torch.Tensor, geom: KVPoolGeometry, q, q_counts, block_tables, selected, plane: int,
                     rope_dim: int, scale: float) -> torch.Tensor:  # fmt: skip
    """[T, H, latent_dim - rope_dim]: absorbed MLA attention of each row of q [T, H, latent_dim] over its `selected`
    positions (int64 [T, topk], -1 = unused) of latent plane `plane` (`dsa_sparse_attention_ref`)."""
    if q.device.type in _PLUGIN_DEVICES:
        return torch.ops.mtp.dsa_sparse_attention(q, q_counts, selected, block_tables, pool_ptr, plane, geom.num_planes,
                                                  geom.num_blocks, geom.block_size, geom.head_dim, geom.dtype_code,
                                                  rope_dim, scale)  # fmt: skip
    pool = view_pool(int(pool_ptr[0]), geom, q.device)
    return dsa_sparse_attention(pool, q, q_counts, block_tables, selected, plane, rope_dim, scale)


def index_topk(pool_ptr: torch.Tensor, geom: KVPoolGeometry, q, weights, q_counts, kv_lens, block_tables, plane: int,
               topk: int, scale: float) -> torch.Tensor:  # fmt: skip
    """int64 [T, topk] selected positions per row (-1 = unused): the indexer-key plane `plane` of the pool at
    `pool_ptr` scored by queries q [T, heads, dim] with per-head weights [T, heads] (`dsa_index_topk_ref`)."""
    if q.device.type in _PLUGIN_DEVICES:
        return torch.ops.mtp.dsa_index_topk(q.float(), weights.float(), q_counts, kv_lens, block_tables, pool_ptr,
                                            plane, geom.num_planes, geom.num_blocks, geom.block_size, geom.head_dim,
                                            geom.dtype_code, topk, scale)  # fmt: skip
    pool = view_pool(int(pool_ptr[0]), geom, q.device)
    return dsa_index_topk(pool, q, weights, q_counts, kv_lens, block_tables, plane, topk, scale)


def _slots(block_tables: torch.Tensor, r: int, n: int, block_size: int) -> torch.Tensor:
    """Flat pool slots (block * block_size + offset) of request r's positions 0..n-1."""
    pos = torch.arange(n, device=block_tables.device)
    return block_tables[r, pos // block_size].long() * block_size + pos % block_size


def _plane_rows(pool: torch.Tensor, plane: int) -> torch.Tensor:
    """[num_blocks * block_size, row_dim] view of one plane of a kv_kind 1 pool."""
    return pool[plane, 0].reshape(-1, pool.shape[-1])


def dsa_index_topk(pool, q, weights, q_counts, kv_lens, block_tables, plane: int, topk: int, scale: float):
    """`dsa_index_topk_ref`, vectorised: int64 [T, topk] selected positions, -1 = unused slot."""
    block_size, dim = pool.shape[3], q.shape[-1]
    rows = _plane_rows(pool, plane)
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int64, device=q.device)
    row = 0
    for r in range(q_counts.shape[0]):
        n_q, n_kv = int(q_counts[r]), int(kv_lens[r])
        if n_q == 0:
            continue
        keys = rows[_slots(block_tables, r, n_kv, block_size), :dim].float()  # [n_kv, Di]
        qr = q[row : row + n_q].float()  # [n_q, Hi, Di]
        per_head = torch.relu(torch.matmul(qr, keys.T) * scale)  # [n_q, Hi, n_kv]
        scores = torch.matmul(weights[row : row + n_q].float().unsqueeze(-2), per_head).squeeze(-2)  # [n_q, n_kv]
        q_pos = n_kv - n_q + torch.arange(n_q, device=q.device)
        scores = scores.masked_fill(torch.arange(n_kv, device=q.device)[None, :] > q_pos[:, None], float("-inf"))
        k = min(topk, n_kv)
        picked = scores.topk(k, dim=-1).indices
        visible = (q_pos + 1)[:, None]  # a row seeing fewer than k positions picked masked ones too: drop them
        picked = torch.where(torch.arange(k, device=q.device)[None, :] < visible, picked, n_kv).sort(-1).values
        out[row : row + n_q, :k] = torch.where(picked < n_kv, picked, -1)  # ascending, as the C++ kernel
        row += n_q
    return out


def dsa_sparse_attention(pool, q, q_counts, block_tables, selected, plane: int, rope_dim: int, scale: float):
    """`dsa_sparse_attention_ref`, vectorised: [T, H, latent_dim - rope_dim] in q's dtype."""
    block_size = pool.shape[3]
    rows = _plane_rows(pool, plane)
    out = torch.zeros(q.shape[0], q.shape[1], q.shape[2] - rope_dim, dtype=q.dtype, device=q.device)
    row = 0
    for r in range(q_counts.shape[0]):
        n_q = int(q_counts[r])
        if n_q == 0:
            continue
        sel = selected[row : row + n_q]  # [n_q, k]
        valid = sel >= 0
        pos = sel.clamp(min=0)
        slots = block_tables[r, pos // block_size].long() * block_size + pos % block_size
        lat = rows[slots].float()  # [n_q, k, latent_dim]
        scores = torch.einsum("qhd,qkd->qhk", q[row : row + n_q].float(), lat) * scale
        weights = scores.masked_fill(~valid[:, None, :], float("-inf")).softmax(-1)
        out[row : row + n_q] = torch.einsum("qhk,qkr->qhr", weights, lat[..., rope_dim:]).to(q.dtype)
        row += n_q
    return out
