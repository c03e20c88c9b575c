"""Expert-parallel routed experts over MPI: the token exchange behind `mtp::moe_experts` with ep_size > 1.

Without tensor parallelism the ep group is MPI.COMM_WORLD (all ranks); rank r holds global experts
[r*E/ep, (r+1)*E/ep). Each (token, slot) pair travels to the rank owning its expert (Alltoall of counts, then
Alltoallv of the rows and expert ids), is computed there by the C++ kernel `mtp::moe_experts_local`, comes back
by the reverse Alltoallv, and is weighted and summed at its origin.

The C++ CPU kernel of `mtp::moe_experts` calls `mtp::moe_experts_exchange` (schema in plugins/csrc/registration.cpp,
implemented here) when ep_size > 1 or tp_size > 1: the exchange is mpi4py and stays Python, the expert math is C++.

With tensor parallelism (`moe_experts_tp`, the contract of docs/ARCHITECTURE.md §8) the column of tp_rank t owns
experts [t*E/TP, (t+1)*E/TP): EP == TP holds them all on the one rank (no exchange); EP == W splits them over the
column comm (one rank per DP group) and runs the same exchange there. Pairs whose expert belongs to another
column contribute 0 here; the model's one TP all-reduce per block sums the columns.

Every rank of a group must call this the same number of times per step, including a rank with 0 tokens (it
sends nothing but still joins both collectives); otherwise the group deadlocks (docs/ARCHITECTURE.md §5,
invariant 9). Rows travel as fp32 whatever the activation dtype (MPI has no bf16 type, and the reference
accumulates in fp32); this is the CPU transport, a GPU build would use NCCL instead. The exchange's wall time
counts in `plugins.collectives.collective_seconds()`.

The quantized engines' experts (`mtp-build --quantize int8 | int4`, FP8 checkpoints) take the same exchange:
`mtp::moe_experts_int8_exchange`, `_int4_exchange` and `_fp8_exchange` (defined here; builder/quantized_weights.py
rewrites a multi-rank `mtp::moe_experts` into them) hold this rank's experts in their stored format, and each rank
computes the pairs it receives with the matching local kernel (`mtp::moe_experts_int8` / `_int4` / `_fp8` at the
rank's expert offset): the rows, ids and results exchanged are the float path's.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

import plugins.cpp_ops  # noqa: F401  (mtp::moe_experts_local, the C++ local expert kernel)
from plugins.collectives import groups, timed

# The experts held on this rank, whatever their stored format: (x fp32 [n, H], topk_ids [n, K] global ids,
# topk_weights [n, K], expert_offset: the global id of the first one held) -> [n, H]; ids held elsewhere contribute 0.
LocalExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def float_experts(w_gate_up: torch.Tensor, w_down: torch.Tensor) -> LocalExperts:
    """The float experts [E_local, 2I, H] / [E_local, H, I], computed by the C++ `mtp::moe_experts_local`."""
    gu, dn = w_gate_up.cpu(), w_down.cpu()
    return lambda x, ids, weights, offset: torch.ops.mtp.moe_experts_local(x, ids, weights, gu, dn, offset)


@torch.library.impl("mtp::moe_experts_exchange", "CPU")
def moe_experts_exchange(x, topk_ids, topk_weights, w_gate_up, w_down, num_experts: int, ep_size: int, tp_size: int,
                         tp_rank: int) -> torch.Tensor:  # fmt: skip
    """`mtp::moe_experts` with ep_size > 1 or tp_size > 1 (its C++ kernel forwards those calls here)."""
    return parallel_experts(x, topk_ids, topk_weights, float_experts(w_gate_up, w_down), w_gate_up.shape[0],
                            num_experts, ep_size, tp_size, tp_rank)  # fmt: skip


def parallel_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, local: LocalExperts,
                     num_local: int, num_experts: int, ep_size: int, tp_size: int,
                     tp_rank: int) -> torch.Tensor:  # fmt: skip
    """The routed experts' output [T, H] in x's dtype (with TP: this rank's partial sum), the `num_local` experts held
    here computed by `local`."""
    if tp_size > 1:
        return moe_experts_tp(x, topk_ids, topk_weights, local, num_local, num_experts, ep_size, tp_size, tp_rank)
    return moe_experts_ep(x, topk_ids, topk_weights, local, num_local, num_experts, ep_size)


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

    with timed():
        comm.Alltoallv([send, layout(send_rows), mpi_type], [recv, layout(recv_rows), mpi_type])
    return recv.reshape(-1, width) if width > 1 else recv


def moe_experts_ep(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, K] global expert ids
    topk_weights: torch.Tensor,  # [T, K]
    local: LocalExperts,  # this rank's experts: E/ep of them
    num_local: int,
    num_experts: int,
    ep_size: int,
) -> torch.Tensor:
    """Routed-expert output [T, H] in x's dtype, equal to moe_experts_ref with all experts held locally."""
    comm = _comm()
    if comm.Get_size() != ep_size:
        raise ValueError(f"ep_size {ep_size} != MPI world size {comm.Get_size()}: the ep group is all ranks")
    if num_experts % ep_size:
        raise ValueError(f"{num_experts} experts do not split over ep_size {ep_size}")
    return exchange_experts(x, topk_ids, topk_weights, local, num_local, num_experts, comm, 0, num_experts)


def moe_experts_tp(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    local: LocalExperts,  # this rank's experts: E/ep of them
    num_local: int,
    num_experts: int,
    ep_size: int,
    tp_size: int,
    tp_rank: int,
) -> torch.Tensor:
    """This TP rank's partial routed output [T, H]: the pairs of its column's experts, others 0."""
    if num_experts % ep_size or ep_size % tp_size:
        raise ValueError(f"{num_experts} experts, ep_size {ep_size}, tp_size {tp_size}: ep must split E and be a "
                         "multiple of tp")  # fmt: skip
    lo = tp_rank * (num_experts // tp_size)
    hi = lo + num_experts // tp_size
    if ep_size == tp_size:  # the whole column is here: no exchange (the local kernel skips other ranks' experts)
        return local(x, topk_ids, topk_weights, lo).to(x.dtype)
    column = groups(tp_size)[1]
    if column.Get_size() != ep_size // tp_size:
        raise ValueError(f"column comm has {column.Get_size()} ranks, ep_size/tp_size = {ep_size // tp_size}")
    return exchange_experts(x, topk_ids, topk_weights, local, num_local, num_experts, column, lo, hi)


def exchange_experts(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, K] global expert ids
    topk_weights: torch.Tensor,  # [T, K]
    local: LocalExperts,  # this rank's experts
    num_local: int,  # (hi-lo)/size of them
    num_experts: int,
    comm,
    lo: int,
    hi: int,
) -> torch.Tensor:
    """Experts [lo, hi) split evenly over `comm` (member i holds lo + [i*n, (i+1)*n)); pairs routed to experts
    outside [lo, hi) are not sent and contribute 0. Returns [T, H] in x's dtype."""
    rank, size = comm.Get_rank(), comm.Get_size()
    per_rank = (hi - lo) // size
    if num_local != per_rank:
        raise ValueError(f"rank {rank} must hold {per_rank} experts, got {num_local}")
    hidden = x.shape[1]
    num_slots = topk_ids.shape[1]

    # Dispatch: one entry per (token, slot) of an expert in [lo, hi), grouped by destination rank.
    ids = topk_ids.reshape(-1).long().cpu()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
        raise ValueError(f"expert ids must lie in 0..{num_experts - 1}")
    pairs = torch.arange(ids.numel())
    if lo > 0 or hi < num_experts:
        pairs = pairs[(ids >= lo) & (ids < hi)]
    dest = (ids[pairs] - lo) // per_rank
    order = pairs[torch.argsort(dest, stable=True)]
    token_of_pair = order // num_slots
    send_rows = np.bincount(dest.numpy(), minlength=size).astype(np.int64)
    recv_rows = np.empty(size, dtype=np.int64)
    with timed():
        comm.Alltoall(send_rows, recv_rows)

    rows = x.detach().cpu().float()[token_of_pair].numpy()
    recv_x = _alltoallv(comm, rows, send_rows, recv_rows, hidden)
    recv_ids = _alltoallv(comm, ids[order].numpy(), send_rows, recv_rows, 1)

    # Compute each received pair as its own "token" with one slot of weight 1; weighting happens at the origin.
    n_recv = recv_ids.shape[0]
    y = local(torch.from_numpy(recv_x).reshape(n_recv, hidden), torch.from_numpy(recv_ids).reshape(n_recv, 1),
              torch.ones(n_recv, 1), lo + rank * per_rank)  # fmt: skip

    # Return: the reverse exchange brings each pair's result back in the order it was sent.
    back = _alltoallv(comm, y.float().numpy(), recv_rows, send_rows, hidden).reshape(-1, hidden)
    weights = topk_weights.reshape(-1).float().cpu()[order]
    out = torch.zeros(x.shape[0], hidden, dtype=torch.float32)
    out.index_add_(0, token_of_pair, torch.from_numpy(back) * weights[:, None])
    return out.to(device=x.device, dtype=x.dtype)


# The quantized experts' forms of `mtp::moe_experts` with ep_size > 1 or tp_size > 1 (fp32 x, fp32 out): the stored
# format's weights and scales as the single-rank op takes them (its schema, plugins/csrc/registration.cpp), then the
# exchange's four ints. Defined in Python with their kernel: the exchange is Python, and its per-rank compute calls
# the C++ single-rank op at this rank's expert offset.
_QUANTIZED_INPUTS = ("Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w_gate_up, Tensor w_gate_up_scale, "
                     "Tensor w_down, Tensor w_down_scale")  # fmt: skip
_PARALLEL_ATTRS = "int num_experts, int ep_size, int tp_size, int tp_rank"


def _define_quantized_exchange(fmt: str, format_attrs: str) -> None:
    """`mtp::moe_experts_<fmt>_exchange`, whose experts `mtp::moe_experts_<fmt>` computes (format_attrs: the ints
    that op takes between the scales and expert_offset: int4's group_size)."""
    qualname = f"mtp::moe_experts_{fmt}_exchange"
    torch.library.define(qualname, f"({_QUANTIZED_INPUTS}, {format_attrs}{_PARALLEL_ATTRS}) -> Tensor")
    kernel = getattr(torch.ops.mtp, f"moe_experts_{fmt}").default

    def exchange(x, topk_ids, topk_weights, w_gate_up, w_gate_up_scale, w_down, w_down_scale, *attrs):
        *format_args, num_experts, ep_size, tp_size, tp_rank = attrs

        def local(rows, ids, weights, offset):
            return kernel(rows, ids, weights, w_gate_up, w_gate_up_scale, w_down, w_down_scale, *format_args, offset)

        return parallel_experts(x, topk_ids, topk_weights, local, w_gate_up.shape[0], num_experts, ep_size, tp_size,
                                tp_rank)  # fmt: skip

    def fake(x, *_):
        return torch.empty_like(x, dtype=torch.float32)

    torch.library.impl(qualname, "CPU")(exchange)
    torch.library.register_fake(qualname)(fake)


for _fmt, _attrs in (("fp8", ""), ("int8", ""), ("int4", "int group_size, ")):
    _define_quantized_exchange(_fmt, _attrs)
