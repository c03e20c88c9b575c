"""Run under `mpirun -np N`: `mtp::all_reduce` / `mtp::all_gather` (and their numpy forms used by the ONNX
Runtime ops) against a numpy reference, for every tp_size that divides N; fp32 and bf16; empty rows.
Prints COLLECTIVES_RESULT failures=F ranks=N on rank 0; exits non-zero on a mismatch."""

from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from tests.mpi_launch import abort_on_error


def main() -> int:
    from plugins import collectives

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    failures = []
    for tp in [t for t in (1, 2, 4) if size % t == 0]:
        tp_comm, column = collectives.groups(tp)
        dp_rank, tp_rank = divmod(rank, tp)
        if (tp_comm.Get_rank(), tp_comm.Get_size(), column.Get_rank(), column.Get_size()) != (
            tp_rank,
            tp,
            dp_rank,
            size // tp,
        ):
            failures.append(f"tp{tp}: comm ranks")
        for shape in [(3, 5), (0, 7), (2, 3, 4), (6,)]:
            for dtype in (torch.float32, torch.bfloat16):
                # Every rank draws every rank's input from one seed, so each can compute the reference.
                gen = np.random.default_rng(7 + tp)
                inputs = [gen.standard_normal((size, *shape)).astype(np.float32)[r] for r in range(size)]
                inputs = [torch.from_numpy(a).to(dtype).float().numpy() for a in inputs]  # bf16-representable
                group = [inputs[dp_rank * tp + t] for t in range(tp)]
                x = torch.from_numpy(inputs[rank]).to(dtype)
                red = torch.ops.mtp.all_reduce(x, tp)
                gat = torch.ops.mtp.all_gather(x, tp)
                ref_red, ref_gat = np.sum(group, axis=0), np.concatenate(group, axis=-1)
                tol = 1e-6 if dtype == torch.float32 else 5e-2
                for what, got, ref in (("all_reduce", red, ref_red), ("all_gather", gat, ref_gat)):
                    ok = (
                        got.dtype == dtype
                        and tuple(got.shape) == ref.shape
                        and np.allclose(got.float().numpy(), ref, atol=tol, rtol=tol)
                    )
                    if not ok:
                        failures.append(f"tp{tp} {what} {shape} {dtype}")
                if dtype == torch.float32:
                    np_red = collectives.all_reduce_numpy(inputs[rank], tp)
                    np_gat = collectives.all_gather_numpy(inputs[rank], tp)
                    if not (np.allclose(np_red, ref_red, atol=1e-6) and np.array_equal(np_gat, ref_gat)):
                        failures.append(f"tp{tp} numpy {shape}")
    failures += _moe_tp_cases(rank, size)
    if collectives.collective_seconds() <= 0.0:
        failures.append("collective_seconds did not grow")
    for f in failures:
        print(f"rank {rank}: {f} mismatch", flush=True)
    total = world.allreduce(len(failures))
    if rank == 0:
        print(f"COLLECTIVES_RESULT failures={total} ranks={size}", flush=True)
    return 1 if total else 0


def _moe_tp_cases(rank: int, size: int) -> list[str]:
    """mtp::moe_experts with tp_size > 1, all-reduced over the TP comm, equals moe_experts_ref (contract of
    docs/ARCHITECTURE.md §8): EP == TP (no exchange) and EP == W (column exchange, uneven and empty DP groups)."""
    import plugins.ops  # noqa: F401  (torch.ops.mtp.moe_experts)
    from plugins.mapping import Parallel, rank_mapping
    from plugins.reference import moe_experts_ref

    out: list[str] = []
    num_experts, hidden, inter, top_k = 8, 16, 8, 3
    for tp in [t for t in (2, 4) if size % t == 0]:
        for ep in sorted({tp, size}):
            m = rank_mapping(rank, Parallel(size, ep, tp), num_experts)
            gen = torch.Generator().manual_seed(4321)
            w_gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2
            w_down = torch.randn(num_experts, hidden, inter, generator=gen) * 0.2
            group = torch.Generator().manual_seed(77 + m.dp_rank)  # one batch per DP group, shared by its TP ranks
            tokens = [6, 0, 3, 9][m.dp_rank]
            x = torch.randn(tokens, hidden, generator=group)
            ids = torch.argsort(torch.rand(tokens, num_experts, generator=group), dim=1)[:, :top_k]
            weights = torch.rand(tokens, top_k, generator=group)
            lo, hi = m.expert_lo, m.expert_hi
            part = torch.ops.mtp.moe_experts(x, ids, weights, w_gate_up[lo:hi], w_down[lo:hi], num_experts, ep, tp,
                                             m.tp_rank)  # fmt: skip
            got = torch.ops.mtp.all_reduce(part, tp)
            want = moe_experts_ref(x, ids, weights, w_gate_up, w_down)
            if got.shape != want.shape or not torch.allclose(got, want, atol=1e-5):
                out.append(f"moe tp{tp} ep{ep}")
    return out


if __name__ == "__main__":  # python -m tests.plugins.mpi_collectives_worker, under mpirun
    abort_on_error(main)
