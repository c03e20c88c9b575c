"""Expert-parallel routed experts over MPI: the token exchange behind `mtp::moe_experts` with ep_size > 1.

The ep group is MPI.COMM_WORLD (all ranks); rank r holds global experts [r*E/ep, (r+1)*E/ep). Each
(token, slot) pair travels to the rank owning its expert (Alltoall of counts, then Alltoallv of the rows
and expert ids), is computed there by `plugins.ops.moe_experts_local`, comes back by the reverse
Alltoallv, and is weighted and summed at its origin.

Every rank must call this the same number of times per step, including a rank with 0 tokens (it sends
nothing but still joins both collectives); otherwise the group deadlocks (docs/ARCHITECTURE.md §5, invariant 9).
Rows travel as fp32 whatever the activation dtype (MPI has no bf16 type, and the reference accumulates in
fp32); this is the CPU transport, a GPU build would use NCCL instead.
"""

from __future__ import annotations

import numpy as np
import torch

from plugins.ops import moe_experts_local


def _comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _alltoallv(comm, send: np.ndarray, send_rows: np.ndarray, recv_rows: np.ndarray, width: int) -> np.ndarray:
    """Exchange rows of `width` elements: send_rows[i] rows go to rank i; recv_rows[i] rows come from rank i."""
    from mpi4py import MPI

    send = np.ascontiguousarray(send.reshape(-1))
    recv = np.empty(int(recv_rows.sum()) * width, dtype=send.dtype)
    mpi_type = MPI.FLOAT if send.dtype == np.float32 else MPI.INT64_T

    def layout(rows: np.ndarray) -> tuple[list[int], list[int]]:
        counts = rows * width
        return counts.tolist(), (np.cumsum(counts) - counts).tolist()

    comm.Alltoallv([send, layout(send_rows), mpi_type], [recv, layout(recv_rows), mpi_type])
    return recv.reshape(-1, width) if width > 1 else recv


def moe_experts_ep(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, K] global expert ids
    topk_weights: torch.Tensor,  # [T, K]
    w_gate_up_local: torch.Tensor,  # [E/ep, 2*I, H]: this rank's experts
    w_down_local: torch.Tensor,  # [E/ep, H, I]
    num_experts: int,
    ep_size: int,
) -> torch.Tensor:
    """Routed-expert output [T, H] in x's dtype, equal to moe_experts_ref with all experts held locally."""
    comm = _comm()
    rank, size = comm.Get_rank(), comm.Get_size()
    if size != ep_size:
        raise ValueError(f"ep_size {ep_size} != MPI world size {size}: the ep group is all ranks")
    if num_experts % ep_size:
        raise ValueError(f"{num_experts} experts do not split over ep_size {ep_size}")
    per_rank = num_experts // ep_size
    if w_gate_up_local.shape[0] != per_rank or w_down_local.shape[0] != per_rank:
        raise ValueError(f"rank {rank} must hold {per_rank} experts, got {w_gate_up_local.shape[0]}")
    hidden = x.shape[1]
    num_slots = topk_ids.shape[1]

    # Dispatch: one entry per (token, slot), grouped by destination rank.
    ids = topk_ids.reshape(-1).long().cpu()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
        raise ValueError(f"expert ids must lie in 0..{num_experts - 1}")
    dest = ids // per_rank
    order = torch.argsort(dest, stable=True)
    token_of_pair = order // num_slots
    send_rows = np.bincount(dest.numpy(), minlength=size).astype(np.int64)
    recv_rows = np.empty(size, dtype=np.int64)
    comm.Alltoall(send_rows, recv_rows)

    rows = x.detach().cpu().float()[token_of_pair].numpy()
    recv_x = _alltoallv(comm, rows, send_rows, recv_rows, hidden)
    recv_ids = _alltoallv(comm, ids[order].numpy(), send_rows, recv_rows, 1)

    # Compute each received pair as its own "token" with one slot of weight 1; weighting happens at the origin.
    n_recv = recv_ids.shape[0]
    y = moe_experts_local(
        torch.from_numpy(recv_x).reshape(n_recv, hidden),
        torch.from_numpy(recv_ids).reshape(n_recv, 1),
        torch.ones(n_recv, 1),
        w_gate_up_local.cpu(),
        w_down_local.cpu(),
        expert_offset=rank * per_rank,
    )

    # Return: the reverse exchange brings each pair's result back in the order it was sent.
    back = _alltoallv(comm, y.float().numpy(), recv_rows, send_rows, hidden).reshape(-1, hidden)
    weights = topk_weights.reshape(-1).float().cpu()[order]
    out = torch.zeros(x.shape[0], hidden, dtype=torch.float32)
    out.index_add_(0, token_of_pair, torch.from_numpy(back) * weights[:, None])
    return out.to(device=x.device, dtype=x.dtype)
