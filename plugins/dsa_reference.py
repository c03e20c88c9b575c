"""Reference semantics of DeepSeek Sparse Attention over the paged latent pool (plugins/dsa_ops.py implements them).

Written position by position, like plugins/reference.py (kept apart: that file is at its size limit). A DSA layer
(models/dsa.py) owns two planes of an MLA pool (kv_kind 1): its latent plane `[k_pe ; c_kv]` and its indexer-key
plane, whose rows hold the roped indexer key in their first index_head_dim values.

- `dsa_index_topk_ref`: the lightning indexer's score of every visible (causal) cached position for each query row,
  I(t, s) = sum_h w[t, h] * relu(scale * q[t, h] . k[s]), and the `topk` best positions (in torch.topk's order here;
  the ops return them ascending, which this reference does not pin); rows that see fewer than `topk` positions get -1
  in the unused slots.
- `dsa_sparse_attention_ref`: absorbed MLA attention (as `mla_paged_attention_ref`) over the selected positions only.
"""

from __future__ import annotations

import torch


def _row(pool: torch.Tensor, plane: int, table: torch.Tensor, pos: int) -> torch.Tensor:
    block_size = pool.shape[3]
    return pool[plane, 0, int(table[pos // block_size]), pos % block_size, 0].float()


def dsa_index_topk_ref(
    pool: torch.Tensor,  # [planes, 1, blocks, B, 1, row_dim]
    q: torch.Tensor,  # [T, Hi, Di] roped indexer queries packed by request
    weights: torch.Tensor,  # [T, Hi] per-head weights (weights_proj(x) * Hi^-0.5)
    q_counts: torch.Tensor,  # [R]
    kv_lens: torch.Tensor,  # [R] cached positions after this forward's write
    block_tables: torch.Tensor,  # [R, max_blocks]
    plane: int,  # the indexer-key plane
    topk: int,
    scale: float,  # Di^-0.5
) -> torch.Tensor:
    """int64 [T, topk] selected positions per row (-1 = unused slot); rows past sum(q_counts) are all -1."""
    dim = q.shape[-1]
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int64)
    row = 0
    for r in range(q_counts.shape[0]):
        n_q, n_kv = int(q_counts[r]), int(kv_lens[r])
        for j in range(n_q):
            visible = n_kv - n_q + j + 1
            scores = torch.empty(visible)
            for s in range(visible):
                key = _row(pool, plane, block_tables[r], s)[:dim]
                per_head = torch.relu((q[row].float() @ key) * scale)
                scores[s] = (weights[row].float() * per_head).sum()
            k = min(topk, visible)
            out[row, :k] = scores.topk(k).indices
            row += 1
    return out


def dsa_sparse_attention_ref(
    pool: torch.Tensor,  # [planes, 1, blocks, B, 1, latent_dim]
    q: torch.Tensor,  # [T, H, latent_dim] absorbed queries [q_pe ; q_nope @ W_UK]
    q_counts: torch.Tensor,  # [R]
    block_tables: torch.Tensor,  # [R, max_blocks]
    selected: torch.Tensor,  # int64 [T, topk] positions per row, -1 = unused
    plane: int,  # the latent plane
    rope_dim: int,  # values are latent[:, rope_dim:] (c_kv)
    scale: float,
) -> torch.Tensor:
    """[T, H, latent_dim - rope_dim] in q's dtype (fp32 math); rows past sum(q_counts) are zeros."""
    out = torch.zeros(q.shape[0], q.shape[1], q.shape[2] - rope_dim, dtype=q.dtype)
    row = 0
    for r in range(q_counts.shape[0]):
        for _ in range(int(q_counts[r])):
            positions = [int(p) for p in selected[row] if int(p) >= 0]
            latents = torch.stack([_row(pool, plane, block_tables[r], p) for p in positions])  # [k, latent_dim]
            for h in range(q.shape[1]):
                w = (latents @ q[row, h].float() * scale).softmax(0)
                out[row, h] = (w @ latents[:, rope_dim:]).to(q.dtype)
            row += 1
    return out
