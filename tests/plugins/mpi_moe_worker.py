"""Run under `mpirun -np N`: checks plugins.moe_ep.moe_experts_ep against moe_experts_ref on every rank.

Each rank draws its own tokens (rank 1 gets 0 tokens in the "empty" case) from a seed shared by all ranks,
so every rank can build the full weights and the reference. Exits non-zero on a mismatch.
"""

from __future__ import annotations

import sys

import torch
from mpi4py import MPI

from plugins.reference import moe_experts_ref


def main() -> int:
    import plugins.ops  # noqa: F401  (torch.ops.mtp.moe_experts)

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    num_experts, hidden, inter, top_k = 4 * size, 16, 8, 3
    per_rank = num_experts // size
    failures = 0
    for case, dtype in [("mixed", torch.float32), ("empty", torch.float32), ("mixed", torch.bfloat16)]:
        gen = torch.Generator().manual_seed(1234)  # same weights on every rank
        w_gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2).to(dtype)
        w_down = (torch.randn(num_experts, hidden, inter, generator=gen) * 0.2).to(dtype)
        local = torch.Generator().manual_seed(99 + rank)
        tokens = 0 if (case == "empty" and rank == 1) else 5 + 3 * rank
        x = torch.randn(tokens, hidden, generator=local).to(dtype)
        ids = torch.argsort(torch.rand(tokens, num_experts, generator=local), dim=1)[:, :top_k]  # distinct experts
        weights = torch.rand(tokens, top_k, generator=local)
        lo = rank * per_rank
        out = torch.ops.mtp.moe_experts(
            x, ids, weights, w_gate_up[lo : lo + per_rank], w_down[lo : lo + per_rank], num_experts, size
        )
        ref = moe_experts_ref(x, ids, weights, w_gate_up, w_down)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        ok = out.shape == ref.shape and out.dtype == ref.dtype and torch.allclose(out.float(), ref.float(), atol=tol)
        if not ok:
            failures += 1
            print(f"rank {rank} case {case} {dtype}: mismatch {(out.float() - ref.float()).abs().max()}", flush=True)
    total = comm.allreduce(failures)
    if rank == 0:
        print(f"MOE_EP_RESULT failures={total} ranks={size}", flush=True)
    return 1 if total else 0


if __name__ == "__main__":  # run as `python -m tests.plugins.mpi_moe_worker` under mpirun
    try:
        code = main()
    except BaseException:
        # A rank that dies while the others wait in a collective would hang the job: abort the whole world.
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        MPI.COMM_WORLD.Abort(2)
    sys.exit(code)
