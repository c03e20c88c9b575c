"""Run a test worker under a real `mpirun -np N --oversubscribe`, killed (with its ranks) on timeout, so a hang
fails the test instead of hanging it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def mpirun_path() -> str | None:
    local = Path(sys.executable).parent / "mpirun"
    return str(local) if local.exists() else shutil.which("mpirun")


def run_mpi(np_: int, module: str, *args: str, timeout: int = 180) -> tuple[int, str]:
    """(returncode, combined output) of `mpirun -np np_ python -m module args...`; timeout -> (-9, output + note)."""
    mpirun = mpirun_path()
    assert mpirun is not None, "mpirun not found"
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
    cmd = [mpirun, "-np", str(np_), "--oversubscribe", sys.executable, "-m", module, *args]
    # Own process group: on timeout kill mpirun *and* its ranks, so a hang can never outlive the test.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return -9, output + f"\n[mpirun timed out after {timeout}s]"
    return proc.returncode, output


def abort_on_error(main) -> None:
    """Worker entry: run main(); a rank that raises aborts the whole world (the others would wait forever)."""
    from mpi4py import MPI

    try:
        code = main()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        MPI.COMM_WORLD.Abort(2)
    sys.exit(code)
