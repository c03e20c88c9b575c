"""Tensor-parallel collectives: the communicators, the torch ops `mtp::all_reduce` / `mtp::all_gather`, and
the per-process collective-time counter.

Contract (docs/ARCHITECTURE.md §8, docs/ENGINE_FORMAT.md "Collective nodes"):
  all_reduce(x, tp_size)  sum of x over the TP comm, same shape and dtype
  all_gather(x, tp_size)  concatenation along the last axis over the TP comm, in rank order
Both are the identity when tp_size == 1 (and the model then never calls them, so no node is exported).

`groups(tp_size)` makes the two communicators from MPI.COMM_WORLD by Split, which is itself a collective: every
rank calls it once at start-up (the first op call does it too, but then every rank must reach that call).
The CPU transport is mpi4py with fp32 on the wire (MPI has no bf16 type; sums accumulate in fp32), the
result in x's dtype. CUDA tensors take the same path through host memory; the GPU engines' NCCL path is the
TensorRT plugins of plugins/trt_collectives.py (never executed on this machine).

Every collective's wall time (these two and the moe_ep all-to-all) is added to `collective_seconds()`, so the
runtime can report the share of step time spent communicating.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from plugins.op_backends import ORT_KERNELS, define_torch
from plugins.op_spec import SPECS

_GROUPS: dict[int, tuple[Any, Any]] = {}
_SECONDS = [0.0]
_INSIDE = [0]  # > 0 while this process is inside a collective (a peer asking it hears "in MPI")


def collective_seconds() -> float:
    """Wall seconds this process has spent inside collectives since it started (monotone)."""
    return _SECONDS[0]


def inside_collective() -> bool:
    """This process is inside a collective now (read from the peer-probe thread: runtime/multirank/peer_probe.py)."""
    return _INSIDE[0] > 0


@contextmanager
def timed():
    """Count the enclosed block's wall time as collective time (and mark it as inside one)."""
    t0 = time.perf_counter()
    _INSIDE[0] += 1
    try:
        yield
    finally:
        _INSIDE[0] -= 1
        _SECONDS[0] += time.perf_counter() - t0


def groups(tp_size: int) -> tuple[Any, Any]:
    """(TP comm, column comm) of this rank for `tp_size`, made once and cached.

    TP comm = the tp_size consecutive ranks of my TP group (Split color=dp_rank, key=tp_rank); column comm =
    the ranks with my tp_rank, one per DP group (color=tp_rank, key=dp_rank). Collective: every rank calls it.
    """
    if tp_size not in _GROUPS:
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        rank, size = world.Get_rank(), world.Get_size()
        if size % tp_size:
            raise ValueError(f"tp_size {tp_size} does not divide the MPI world size {size}; launch a multiple of it")
        dp_rank, tp_rank = divmod(rank, tp_size)
        with timed():
            tp_comm = world.Split(color=dp_rank, key=tp_rank)
            column = world.Split(color=tp_rank, key=dp_rank)
        _GROUPS[tp_size] = (tp_comm, column)
    return _GROUPS[tp_size]


def tp_comm(tp_size: int) -> Any:
    comm = groups(tp_size)[0]
    if comm.Get_size() != tp_size:
        raise ValueError(f"TP comm has {comm.Get_size()} ranks, expected tp_size {tp_size}")
    return comm


def _host_f32(x: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(x.detach().to(device="cpu", dtype=torch.float32).numpy())


def all_reduce_numpy(x: np.ndarray, tp_size: int) -> np.ndarray:
    """Sum of fp32 `x` over the TP comm (the ONNX Runtime custom op calls this directly)."""
    from mpi4py import MPI

    send = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(send)
    comm = tp_comm(tp_size)
    with timed():
        comm.Allreduce(send, out, op=MPI.SUM)
    return out


def all_gather_numpy(x: np.ndarray, tp_size: int) -> np.ndarray:
    """fp32 `x` of every TP rank concatenated along the last axis, in rank order (all ranks: same shape)."""
    send = np.ascontiguousarray(x, dtype=np.float32)
    recv = np.empty((tp_size, *send.shape), dtype=np.float32)
    comm = tp_comm(tp_size)
    with timed():
        comm.Allgather(send, recv)
    return np.ascontiguousarray(np.moveaxis(recv, 0, -2).reshape(*send.shape[:-1], tp_size * send.shape[-1]))


def all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """torch.ops.mtp.all_reduce on any device (through host fp32; the GPU transport is NCCL in TensorRT)."""
    if tp_size == 1:
        return x.clone()
    out = torch.from_numpy(all_reduce_numpy(_host_f32(x), tp_size))
    return out.to(device=x.device, dtype=x.dtype)


def all_gather(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    if tp_size == 1:
        return x.clone()
    out = torch.from_numpy(all_gather_numpy(_host_f32(x), tp_size))
    return out.to(device=x.device, dtype=x.dtype)


# Schemas and fakes from their specs (plugins/op_spec.py); these kernels serve every device.
define_torch(SPECS["all_reduce"], all_reduce, "CompositeExplicitAutograd")
define_torch(SPECS["all_gather"], all_gather, "CompositeExplicitAutograd")
ORT_KERNELS["all_reduce"], ORT_KERNELS["all_gather"] = all_reduce_numpy, all_gather_numpy  # fp32 numpy in ORT
