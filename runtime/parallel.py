"""Multi-rank driving under mpirun: data-parallel attention + expert-parallel MoE (design section 8).

Each rank serves its own share of the requests with its own engine; MoE layers exchange tokens with
all-to-all inside the forwards, so all ranks step in lockstep: before each step they agree (allreduce)
whether any rank still has work, and an idle rank runs dummy forwards (runtime/engine.py). Sampling
decisions are per request and each request lives on exactly one rank, so they are made once.

A rank that fails aborts the whole job (MPI Abort) with its error printed, instead of leaving the others
blocked in a collective.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Iterator

from runtime.engine import LLMEngine, RequestOutput


def mpi_world():
    """(comm, rank, size); a single process without MPI is rank 0 of 1."""
    try:
        from mpi4py import MPI
    except ImportError:  # pragma: no cover - mpi4py is a dependency
        return None, 0, 1
    comm = MPI.COMM_WORLD
    return comm, comm.Get_rank(), comm.Get_size()


def lockstep_stream(engine: LLMEngine, comm) -> Iterator[RequestOutput]:
    """Step until no rank has work; every rank calls step() the same number of times."""
    while True:
        busy = engine.has_unfinished()
        if comm is None or comm.Get_size() == 1:
            if not busy:
                return
        elif not comm.allreduce(int(busy)):
            return
        yield from engine.step()


def abort_on_error(fn):
    """Run fn(); on any exception print it with the rank and abort every rank (no silent hang)."""
    comm, rank, size = mpi_world()
    try:
        return fn()
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - we re-raise or abort
        if size <= 1:
            raise
        print(f"[rank {rank}] fatal: {type(e).__name__}: {e}", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        comm.Abort(1)
