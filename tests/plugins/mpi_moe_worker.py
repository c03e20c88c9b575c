"""Run under `mpirun -np N`: checks plugins.moe_ep's exchange against the references on every rank: the float
experts (`mtp::moe_experts` with ep_size N) against moe_experts_ref, and each quantized format's exchange
(`mtp::moe_experts_int8_exchange`, `_int4_exchange`, `_fp8_exchange`: this rank's shard of experts quantized as the
builder stores them) against its single-rank reference over all the experts (moe_experts_int8_ref, ...).

Each rank draws its own tokens (rank 1 gets 0 tokens in the "empty" case) from a seed shared by all ranks,
so every rank can build the full weights and the reference. Exits non-zero on a mismatch.
"""

from __future__ import annotations

import sys

import torch
from mpi4py import MPI

from plugins.reference import (
    FP8_BLOCK,
    moe_experts_fp8_ref,
    moe_experts_int4_ref,
    moe_experts_int8_ref,
    moe_experts_ref,
    quantize_int4,
    quantize_int8,
)

GROUP = 8  # int4's group: divides H = 16 and I = 8


def quantized_experts(fmt: str, w_gate_up: torch.Tensor, w_down: torch.Tensor, gen: torch.Generator) -> list:
    """All experts in `fmt`'s stored form: [w_gate_up, its scales, w_down, its scales] as the builder stores them
    (quantize_int8 / quantize_int4 per expert row; FP8: e4m3 values with random 128 x 128 block scales)."""
    if fmt == "int8":
        return [*quantize_int8(w_gate_up), *quantize_int8(w_down)]
    if fmt == "int4":
        return [*quantize_int4(w_gate_up, GROUP), *quantize_int4(w_down, GROUP)]
    e, two_i, h = w_gate_up.shape
    blocks = lambda n: -(-n // FP8_BLOCK)  # noqa: E731
    gu_scale = torch.rand(e, 2 * blocks(two_i // 2), blocks(h), generator=gen) + 0.5
    dn_scale = torch.rand(e, blocks(h), blocks(two_i // 2), generator=gen) + 0.5
    return [w_gate_up.to(torch.float8_e4m3fn), gu_scale, w_down.to(torch.float8_e4m3fn), dn_scale]


def check_quantized(fmt: str, rank: int, size: int, x, ids, weights, w_gate_up, w_down, num_experts: int) -> bool:
    """This rank's slice of the quantized experts through the exchange op equals the reference over all of them: EP
    (ep_size = size; each rank its own tokens, which travel) and TP (tp_size = ep_size = size, this rank's column: all
    ranks hold rank 0's tokens, none travel, and the ranks' partial outputs summed, as the model's TP all-reduce sums
    them, are the whole)."""
    stored = quantized_experts(fmt, w_gate_up, w_down, torch.Generator().manual_seed(5))  # same on every rank
    per_rank = num_experts // size
    mine = [t[rank * per_rank : (rank + 1) * per_rank].contiguous() for t in stored]
    group = [GROUP] if fmt == "int4" else []
    exchange = getattr(torch.ops.mtp, f"moe_experts_{fmt}_exchange")
    ref = {"int8": moe_experts_int8_ref, "int4": moe_experts_int4_ref, "fp8": moe_experts_fp8_ref}[fmt]
    ok = True
    for mode, tp in (("EP", 1), ("TP", size)):
        rows = (x, ids, weights) if tp == 1 else MPI.COMM_WORLD.bcast((x, ids, weights), root=0)
        out = exchange(*rows, *mine, *group, num_experts, size, tp, rank)
        if tp > 1:
            out = torch.from_numpy(MPI.COMM_WORLD.allreduce(out.numpy()))
        want = ref(*rows, *stored, *group)
        good = out.shape == want.shape and out.dtype == torch.float32 and torch.allclose(out, want, atol=1e-4)
        if not good:
            print(f"rank {rank} {fmt} {mode} exchange: mismatch {(out - want).abs().max()}", flush=True)
        ok = ok and good
    return ok


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
        if dtype == torch.float32:  # the quantized experts' ops take fp32 x (the compiled engine's)
            for fmt in ("int8", "int4", "fp8"):
                failures += not check_quantized(fmt, rank, size, x, ids, weights, w_gate_up, w_down, num_experts)
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
