"""The MPI world, the start-up settings agreement and one-line failure exits under mpirun (docs/ARCHITECTURE.md §8).

Each DP group (a TP group: runtime/multirank/tp_group.py; with TP1 a single rank) serves its own share of the requests;
its leader runs the engine. MoE layers exchange tokens with all-to-all inside the forwards, so the leaders
step in lockstep: before each step they agree (allreduce over the leaders comm) whether any group still has
work, and an idle leader runs dummy forwards (runtime/core/engine.py), which its followers replay. Sampling
decisions are per request and each request lives in exactly one group, so they are made once.

No path may hang silently:
* at start-up the ranks allgather their settings fingerprint (runtime/multirank/fingerprint.py); on any difference
  every rank raises the same `RanksDisagree` (rank 0 prints it) instead of entering mismatched collectives;
* a collective that waits past --collective-timeout ends its rank with one line (runtime/multirank/watchdog.py);
* a rank that fails prints one line and exits non-zero; the launcher then terminates the others, which are
  blocked in a collective (see `exit_failed_rank`).

MPI is initialized only under a launcher: importing mpi4py runs MPI_Init, which in a plain process is
Open MPI's singleton init and leaves a /dev/shm/sm_segment.* file behind every time.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn, TypeVar

from runtime.core.config import ConfigError
from runtime.multirank.fingerprint import first_difference
from runtime.multirank.host_facts import hostname, rank_tag

T = TypeVar("T")
# Set by every launcher we support: Open MPI (mpirun / prterun), PMIx launchers (srun --mpi=pmix), MPICH hydra.
LAUNCHER_ENV = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE")


class EveryRankError(ConfigError):
    """Raised on EVERY rank with the same message, so all ranks exit together without an abort (rank 0 prints)."""


class RanksDisagree(EveryRankError):
    """The start-up settings agreement failed (runtime/multirank/fingerprint.py names the first difference)."""


def launched_by_mpi() -> bool:
    return any(name in os.environ for name in LAUNCHER_ENV)


def mpi_world():
    """(comm, rank, size); a process not started by an MPI launcher is rank 0 of 1 and never imports mpi4py."""
    if not launched_by_mpi():
        return None, 0, 1
    try:
        from mpi4py import MPI
    except ImportError:  # pragma: no cover - mpi4py is a dependency
        return None, 0, 1
    comm = MPI.COMM_WORLD
    return comm, comm.Get_rank(), comm.Get_size()


def agree_on_settings(comm, fingerprint: dict) -> None:
    """Allgather every rank's settings fingerprint (runtime/multirank/fingerprint.py); raise RanksDisagree on
    every rank if any differs. Called once at start-up over COMM_WORLD (followers included)."""
    if comm is None or comm.Get_size() == 1:
        return
    gathered = comm.allgather((hostname(), fingerprint))
    problem = first_difference([fp for _, fp in gathered], [host for host, _ in gathered])
    if problem is not None:
        raise RanksDisagree(problem)


def exit_failed_rank(rank: int, error: BaseException, prog: str, debug: bool = False, code: int = 1) -> NoReturn:
    """Print one line (plus the traceback with debug) and leave at once, without MPI_Finalize.

    The other ranks are blocked in a collective and cannot be told; Open MPI's launcher terminates the
    whole job when one process exits non-zero, and does so with a shorter banner than MPI_Abort's. Under
    another launcher, where that is not guaranteed, MPI_Abort is the fallback that always works.
    """
    try:
        if debug:
            traceback.print_exception(error)
        print(f"{prog}: error: [{rank_tag(rank)}] {describe(error)}", file=sys.stderr)
        sys.stderr.flush()
        sys.stdout.flush()
    except (OSError, ValueError):  # the output's reader (this host's Open MPI daemon) is gone: leave all the same
        pass
    if "OMPI_COMM_WORLD_SIZE" not in os.environ:
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(code)
    os._exit(code)


def describe(error: BaseException) -> str:
    """The one-line form of an error: bad-input errors are their message, anything else names its type."""
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    if isinstance(error, ValueError | FileNotFoundError):
        return str(error)
    return f"{type(error).__name__}: {error}"


def abort_on_error(fn: Callable[[], T], prog: str = "mtp", debug: bool = False) -> T:
    """Run fn(); a multi-rank failure becomes one line and a non-zero exit of the job (no silent hang).

    A single process re-raises (the caller prints it), and so does an EveryRankError (RanksDisagree), which
    every rank raises together and can exit from normally.
    """
    comm, rank, size = mpi_world()
    try:
        return fn()
    except (SystemExit, EveryRankError):
        raise
    except BaseException as e:  # noqa: BLE001 - we re-raise or exit
        if size <= 1:
            raise
        exit_failed_rank(rank, e, prog, debug, code=130 if isinstance(e, KeyboardInterrupt) else 1)
