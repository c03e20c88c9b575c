"""The collective watchdog in one process: the fault knob's format, the one line it prints past the deadline
(in a subprocess, which it ends with exit 1), and that a disarmed or finished wait never fires."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.multirank.watchdog import STARTUP_ENV, Stall, Watchdog, parse_stall, startup_timeout
from tests.runtime.test_mpi_lockstep import ENV, ROOT


def test_parse_stall():
    assert parse_stall(None) is None and parse_stall("") is None
    assert parse_stall("1:17:2.5") == Stall(1, 17, 2.5)
    with pytest.raises(ValueError, match=r"MTP_FAULT_STALL='1:x': expected RANK:STEP:SECONDS"):
        parse_stall("1:x")


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="--collective-timeout 0: must be > 0 seconds"):
        Watchdog(0, rank=0)


SCRIPT = """
import time
from pathlib import Path
from runtime.multirank.watchdog import Watchdog
dog = Watchdog({timeout}, rank=3, prog="mtp-run")
with dog.guard("a quick one"):
    pass
dog.step = 17
with dog.guard("main forward"):
    time.sleep({sleep})
print("survived")
"""


def _run(timeout: float, sleep: float) -> subprocess.CompletedProcess:
    code = SCRIPT.format(timeout=timeout, sleep=sleep)
    return subprocess.run([sys.executable, "-c", code], env={**ENV, "OMPI_COMM_WORLD_SIZE": "1"}, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_a_wait_past_the_deadline_is_one_line_and_exit_1():
    t0 = time.monotonic()
    proc = _run(timeout=0.5, sleep=30)
    assert proc.returncode == 1 and "survived" not in proc.stdout
    assert proc.stderr.strip().splitlines() == [
        "mtp-run: error: [rank 3] step 17: main forward did not complete within 0.5 s (another rank stalled or died); "
        "exiting"], proc.stderr
    assert time.monotonic() - t0 < 20


STARTUP_SCRIPT = """
import time
from runtime.multirank.watchdog import Watchdog
dog = Watchdog(0.5, rank=1, prog="mtp-run")
with dog.guard("communicator split (MPI_Comm_split over every rank)", 1.5):
    time.sleep(1.0)  # past the collective bound, within the start-up one
print("survived the first")
with dog.guard("settings agreement (allgather over every rank)", 1.5):
    time.sleep(30)
print("survived")
"""


def test_start_up_collectives_have_their_own_bound_and_name_start_up():
    """Issue 31: the start-up split / agreement are bounded by startup_timeout, not left unarmed."""
    proc = subprocess.run([sys.executable, "-c", STARTUP_SCRIPT], env={**ENV, "OMPI_COMM_WORLD_SIZE": "1"}, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 1 and proc.stdout.split() == ["survived", "the", "first"], proc.stdout
    assert proc.stderr.strip().splitlines() == [
        "mtp-run: error: [rank 1] start-up: settings agreement (allgather over every rank) did not complete within "
        "1.5 s (another rank stalled or died); exiting"], proc.stderr  # fmt: skip


def test_startup_timeout(monkeypatch):
    monkeypatch.delenv(STARTUP_ENV, raising=False)
    assert startup_timeout(60) == 300 and startup_timeout(900) == 900
    monkeypatch.setenv(STARTUP_ENV, "15")
    assert startup_timeout(60) == 15
    monkeypatch.setenv(STARTUP_ENV, "soon")
    with pytest.raises(ValueError, match="MTP_STARTUP_TIMEOUT='soon': expected a number of seconds > 0"):
        startup_timeout(60)


def test_a_rank_whose_stderr_reader_is_gone_still_exits():
    """Issue 31: a rank whose host's Open MPI daemon died (its stderr pipe has no reader) used to lose its watchdog
    thread to BrokenPipeError and stay blocked forever; it must exit 1 all the same."""
    code = SCRIPT.format(timeout=0.5, sleep=30)
    proc = subprocess.Popen([sys.executable, "-c", code], env={**ENV, "OMPI_COMM_WORLD_SIZE": "1"}, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    proc.stderr.close()  # no reader: the watchdog's line hits EPIPE
    try:
        assert proc.wait(timeout=20) == 1
    finally:
        proc.kill()
        proc.wait()


def test_waits_within_the_deadline_do_not_fire():
    proc = _run(timeout=2, sleep=0.2)
    assert proc.returncode == 0 and proc.stdout.strip() == "survived" and not proc.stderr, proc.stderr


@pytest.mark.parametrize("prog", ["mtp-run", "mtp-serve"])
def test_bad_collective_timeout_flag_is_one_line(prog):
    bin_dir = Path(sys.executable).parent
    extra = ["--prompt", "x"] if prog == "mtp-run" else ["--frontend", "openai"]
    proc = subprocess.run([str(bin_dir / prog), "--checkpoint", str(ROOT / "models" / "tiny"), *extra,
                           "--collective-timeout", "0"], env=ENV, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"{prog}: error: --collective-timeout 0: must be > 0 seconds"]


def test_bad_grammar_flag_of_mtp_serve_is_one_line():
    """It was checked after the engine loaded, outside the start-up error handling: a traceback."""
    proc = subprocess.run([str(Path(sys.executable).parent / "mtp-serve"), "--checkpoint", str(ROOT / "models" / "tiny"),
                           "--frontend", "openai", "--grammar-compile-timeout", "-1"], env=ENV, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["mtp-serve: error: --grammar-compile-timeout must be > 0, got -1"]
