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
    if collectives.collective_seconds() <= 0.0:
        failures.append("collective_seconds did not grow")
    for f in failures:
        print(f"rank {rank}: {f} mismatch", flush=True)
    total = world.allreduce(len(failures))
    if rank == 0:
        print(f"COLLECTIVES_RESULT failures={total} ranks={size}", flush=True)
    return 1 if total else 0


if __name__ == "__main__":  # python -m tests.plugins.mpi_collectives_worker, under mpirun
    abort_on_error(main)
