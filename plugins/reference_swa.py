"""PyTorch reference of `mtp::swa_paged_attention`: paged GQA attention in its sliding-window mode with attention
sinks (MiMo-V2-Flash's SWA layers). A module of its own beside plugins/reference.py (the other ops' references),
written the same way: for clarity, a loop over requests; every other implementation must match it.
"""

from __future__ import annotations

import torch


def swa_paged_attention_ref(
    pool: torch.Tensor,  # [planes, 2, blocks, B, Hkv, D]
    q: torch.Tensor,  # [T, Hq, D] packed by request
    q_counts: torch.Tensor,  # [R] queries of each request (0 = padded request)
    kv_lens: torch.Tensor,  # [R] total KV length of each request, including these queries
    block_tables: torch.Tensor,  # [R, max_blocks]
    plane: int,
    scale: float,
    window: int,  # keys seen per query, the query itself included (transformers' `sliding_window`); 0 = all
    sinks: torch.Tensor,  # [Hq] one sink logit per query head
) -> torch.Tensor:
    """Query j of request r sits at p = kv_lens[r]-q_counts[r]+j and sees keys max(0, p-window+1)..p. Its softmax
    runs over those scores plus its head's sink logit, whose probability is dropped (transformers'
    eager_attention_forward with `s_aux`): the denominator gains exp(sink_h - m), m the max of scores and sink.

    Rows past sum(q_counts) are padding and come back as zeros. Computed in fp32, returned in q's dtype.
    """
    block_size = pool.shape[3]
    num_q_heads, num_kv_heads = q.shape[1], pool.shape[4]
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(q)
    row = 0
    for r in range(q_counts.shape[0]):
        n_q, n_kv = int(q_counts[r]), int(kv_lens[r])
        if n_q == 0:
            continue
        positions = torch.arange(n_kv)
        blocks = block_tables[r, positions // block_size].long()
        slots = positions % block_size
        keys = pool[plane, 0, blocks, slots].float().repeat_interleave(group, dim=1)  # [n_kv, Hq, D]
        values = pool[plane, 1, blocks, slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[row : row + n_q].float(), keys) * scale
        q_pos = n_kv - n_q + torch.arange(n_q)
        hidden = positions[None, :] > q_pos[:, None]  # [n_q, n_kv]: the future
        if window > 0:
            hidden |= positions[None, :] <= q_pos[:, None] - window  # left of the window
        scores = scores.masked_fill(hidden[None], float("-inf"))
        sink = sinks.float()[:, None, None].expand(num_q_heads, n_q, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        out[row : row + n_q] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
        row += n_q
    return out
