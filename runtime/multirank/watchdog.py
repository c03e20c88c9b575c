"""The collective watchdog: a rank blocked in a collective past `--collective-timeout` exits with one line.

A collective whose partner stalled (or died without the launcher noticing) blocks forever inside MPI. Each
rank therefore arms a deadline around every collective-bearing wait (the leaders' lockstep allreduce and
draft-length allgather, every executor call, a follower's wait for the leader's next call within a step);
one daemon thread checks the deadline a few times a second and, past it, prints

    mtp-run: error: [rank 1] step 17: main forward did not complete within 60 s (another rank stalled or died); exiting

(naming the peer instead when it can: before printing, the rank asks the others what they are doing,
runtime/multirank/peer_probe.py, e.g. "(rank 1 on B does not answer: its host or the link is down)") and leaves (os._exit, as runtime/parallel.exit_failed_rank: MPI_Finalize would block on the stalled peer), so the
launcher ends the job. Arming is two attribute writes, so it costs nothing per call. Before leaving, the rank says
its line to whoever registered for it (`on_fire`: a serving leader fails its in-flight requests with it, so a client
gets the error instead of a bare disconnect), for at most LAST_WORDS_S.

Idle waits are NOT armed: a serving leader with no requests issues no collective, and its followers wait
for the next step's first call with the deadline off (the leader tells them a step ended). A rank that
dies while idle ends the job through the launcher (Open MPI terminates the job when a rank exits non-zero).
Loading is not armed: load times legitimately differ. The start-up collectives after it (the communicator
split, the settings agreement) are, with the longer `startup_timeout` (max(--collective-timeout, 300 s), or
MTP_STARTUP_TIMEOUT seconds): a rank waits there for the slowest rank's load, but a split that never returns
(issue 31: two hosts with one hostname) ends the job with one line naming "start-up" instead of hanging.

Fault injection (tests only, docs/RELIABILITY.md): `MTP_FAULT_STALL=RANK:STEP:SECONDS` makes rank RANK sleep
SECONDS inside the main forward of its step STEP (counted from 1), where its own deadline is armed, one timeout
later than the ranks that wait on it. With `MTP_FAULT_STALL_MARK=PATH` too, that rank creates PATH as its sleep
begins, so a test knows the stall is in place (a sampled "in a sleep" cannot tell it from a sleep inside MPI start-up).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from runtime.multirank.host_facts import rank_tag

DEFAULT_TIMEOUT_S = 60.0
STARTUP_MIN_S = 300.0  # the start-up collectives wait for the slowest rank's load (compiled packages: minutes)
STARTUP_ENV = "MTP_STARTUP_TIMEOUT"
FAULT_ENV = "MTP_FAULT_STALL"
FAULT_MARK_ENV = "MTP_FAULT_STALL_MARK"
EXIT_CODE = 1
LAST_WORDS_S = 1.5  # what the `on_fire` callbacks may take before the rank leaves (their events reach the clients)


@dataclass(frozen=True)
class Stall:
    """An injected stall: rank `rank` sleeps `seconds` in the main forward of step `step`."""

    rank: int
    step: int
    seconds: float


def parse_stall(text: str | None) -> Stall | None:
    """`RANK:STEP:SECONDS` -> Stall; None for unset/empty. Bad text is a ValueError naming the format."""
    if not text:
        return None
    try:
        rank, step, seconds = text.split(":")
        return Stall(int(rank), int(step), float(seconds))
    except ValueError:
        raise ValueError(f"{FAULT_ENV}={text!r}: expected RANK:STEP:SECONDS, e.g. 1:5:30") from None


def check_timeout(seconds: float) -> float:
    if not seconds > 0:
        raise ValueError(f"--collective-timeout {seconds:g}: must be > 0 seconds")
    return float(seconds)


def startup_timeout(collective_timeout: float) -> float:
    """The bound on the start-up collectives: MTP_STARTUP_TIMEOUT seconds if set, else max(collective, 300 s)."""
    text = os.environ.get(STARTUP_ENV)
    if text:
        try:
            return check_timeout(float(text))
        except ValueError:
            raise ValueError(f"{STARTUP_ENV}={text!r}: expected a number of seconds > 0") from None
    return max(float(collective_timeout), STARTUP_MIN_S)


class Watchdog:
    """One per rank. `guard(what)` arms the deadline around a wait; `step` names the step in the message."""

    def __init__(self, timeout_s: float, rank: int, prog: str = "mtp", poll_s: float | None = None) -> None:
        self.timeout_s = check_timeout(timeout_s)
        self.rank, self.prog = rank, prog
        self.step = 0  # the step being executed (1-based; 0 = before the first step)
        self._what: str | None = None
        self._limit = self.timeout_s  # the armed wait's bound (longer for the start-up collectives)
        self._deadline: float | None = None
        self._poll = poll_s if poll_s is not None else min(0.25, self.timeout_s / 4)
        self.stall = parse_stall(os.environ.get(FAULT_ENV))
        self._on_fire: list[Callable[[str], None]] = []
        self._armed_at = 0.0
        self._in_mpi = 0  # > 0 while in a wait that is one MPI call (a guard with mpi=True, `mpi_wait`)
        self.blame: Callable[[], str | None] | None = None  # names the peers to blame (peer_probe.blame), once set
        self._why: str | None = None
        threading.Thread(target=self._watch, name="mtp-collective-watchdog", daemon=True).start()

    def arm(self, what: str, timeout_s: float | None = None) -> None:
        self._what = what
        self._limit = timeout_s or self.timeout_s
        self._armed_at = time.monotonic()
        self._deadline = self._armed_at + self._limit

    def disarm(self) -> None:
        self._deadline = None

    @contextlib.contextmanager
    def mpi_wait(self):
        """Marks an unarmed wait that is one MPI call (a follower's idle wait for its leader): a peer asking this
        rank then hears "in MPI", not a rank to blame."""
        self._in_mpi += 1
        try:
            yield
        finally:
            self._in_mpi -= 1

    def status(self) -> str:
        """What this rank answers a peer that asks (runtime/multirank/peer_probe.py): inside MPI or not, its step,
        the armed wait and for how long."""
        from runtime.multirank.peer_probe import IN_MPI, NOT_IN_MPI

        collectives = sys.modules.get("plugins.collectives")  # loaded by every multi-rank engine's ops
        inside = self._in_mpi > 0 or bool(collectives and collectives.inside_collective())
        what = self._what if self._deadline is not None else None
        doing = f"{what}, armed {time.monotonic() - self._armed_at:.1f} s ago" if what else "no wait armed"
        return f"{IN_MPI if inside else NOT_IN_MPI}: step {self.step}, {doing}"

    def on_fire(self, fn: Callable[[str], None]) -> None:
        """Call fn(the watchdog's line) when it fires, before the rank leaves (from the watchdog's thread, while the
        rank's main thread is still blocked: fn must only hand the line over, e.g. to an event loop)."""
        self._on_fire.append(fn)

    def guard(self, what: str, timeout_s: float | None = None, mpi: bool = False) -> _Guard:
        """Arm the deadline around a wait; mpi=True: the wait is one MPI call (not compute that calls collectives)."""
        return _Guard(self, what, timeout_s, mpi)

    def guarded(self, fn, what: str):
        """fn wrapped so that every call is armed (the leaders comm's allreduce / allgather)."""

        def call(*args, **kwargs):
            with self.guard(what, mpi=True):
                return fn(*args, **kwargs)

        return call

    def maybe_stall(self) -> None:
        """The test-only fault: sleep inside an armed main forward of the configured rank and step."""
        s = self.stall
        if s is not None and s.rank == self.rank and s.step == self.step:
            # The ranks waiting on this one are the watchdog's point: this rank's own deadline (armed at about the
            # same moment) moves one timeout later, so theirs fire first - otherwise which rank reports is a race
            # (whichever exits first, the launcher kills the rest). It still leaves on its own if nobody ends it.
            if self._deadline is not None:
                self._deadline += self._limit
            if mark := os.environ.get(FAULT_MARK_ENV):
                open(mark, "w").close()
            time.sleep(s.seconds)

    def message(self, what: str, limit: float | None = None) -> str:
        when = f"step {self.step}" if self.step else "start-up"
        why = self._why or "another rank stalled or died"
        return (f"{self.prog}: error: [{rank_tag(self.rank)}] {when}: {what} did not complete within "
                f"{limit or self.timeout_s:g} s ({why}); exiting")  # fmt: skip

    def _watch(self) -> None:
        while True:
            time.sleep(self._poll)
            deadline, what, limit = self._deadline, self._what, self._limit
            if deadline is not None and time.monotonic() > deadline and what is not None:
                self._fire(what, limit)

    def _fire(self, what: str, limit: float | None = None) -> None:
        if self.blame is not None:
            with contextlib.suppress(Exception):  # naming the peer is a courtesy: leave all the same
                self._why = self.blame()
        try:
            print(self.message(what, limit), file=sys.stderr)
            sys.stderr.flush()
        except (OSError, ValueError):  # stderr's reader (this host's Open MPI daemon) is gone: leave all the same
            pass
        if self._on_fire:  # bounded: a callback that blocks must not keep the rank alive
            last = threading.Thread(target=self._last_words, args=(self.message(what, limit),), daemon=True)
            last.start()
            last.join(LAST_WORDS_S)
        if "OMPI_COMM_WORLD_SIZE" not in os.environ:  # not Open MPI: its job-ending on a non-zero exit is not given
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(EXIT_CODE)
        os._exit(EXIT_CODE)

    def _last_words(self, line: str) -> None:
        t0 = time.monotonic()
        for fn in self._on_fire:
            with contextlib.suppress(Exception):  # leaving anyway; the line is on stderr
                fn(line)
        time.sleep(max(0.0, min(0.5, LAST_WORDS_S - (time.monotonic() - t0) - 0.2)))  # the frontends send them


class _Guard:
    __slots__ = ("dog", "mpi", "timeout_s", "what")

    def __init__(self, dog: Watchdog, what: str, timeout_s: float | None = None, mpi: bool = False) -> None:
        self.dog, self.what, self.timeout_s, self.mpi = dog, what, timeout_s, mpi

    def __enter__(self) -> None:
        self.dog._in_mpi += self.mpi
        self.dog.arm(self.what, self.timeout_s)

    def __exit__(self, *exc) -> None:
        self.dog.disarm()
        self.dog._in_mpi -= self.mpi
