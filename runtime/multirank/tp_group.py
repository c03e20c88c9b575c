"""Tensor-parallel groups under mpirun: the leader runs the engine, followers replay its executor calls.

Mapping (the TP contract, docs/RUNTIME.md "Multi-rank mappings"): rank = dp_rank * TP + tp_rank; a TP group is
TP consecutive ranks and its leader is tp_rank 0. In each group only the leader runs the LLMEngine (schedule,
accept, sample, plan, emit); every executor call it makes (main step, draft depth, commit write, block copy)
is broadcast over the TP comm with its numpy input dataclass and replayed by the followers, whose outputs are
discarded: the collectives inside the sharded forwards (all-reduce, all-gather, the MoE all-to-all) then
match call for call. Leaders of different DP groups keep the DP lockstep (busy check, draft-length
agreement, idle dummies: docs/ARCHITECTURE.md §5 invariant 9) over the leaders comm.

The command stream on the TP comm, leader -> followers (pickled bcast):
    (CALL, method, input, step)   run `method(input)` on the local executor, discard the output
    (STEP_END, step)              the leader finished a step: the next wait may be idle (not armed)
    (STOP,)                       leave follow(): the leader is done (end of mtp-run, server shutdown)
A leader that fails exits at once (runtime/parallel.exit_failed_rank); the launcher then ends its
followers, which are blocked in the bcast, and the collective watchdog (runtime/multirank/watchdog.py) ends any
rank whose peer stalls mid-step.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from typing import Any

from plugins.mapping import RankMapping
from runtime.multirank.parallel import exit_failed_rank
from runtime.multirank.watchdog import Watchdog

CALL, STEP_END, STOP = "call", "step_end", "stop"
# What each executor call is called in the watchdog's message.
CALL_NAMES = {"run_main": "main forward", "run_draft": "draft forward", "run_commit": "commit write",
              "copy_blocks": "block copy"}  # fmt: skip


@dataclass
class RankRole:
    """One rank's part in a multi-rank job: its mapping, comms, watchdog, and the raw executor it runs."""

    mapping: RankMapping
    tp_comm: Any  # the command stream's comm: a Dup of my TP group's (None when tp_size == 1)
    leaders_comm: Any  # my column comm: for a leader, the DP lockstep group of all leaders
    dog: Watchdog
    executor: Any  # the unwrapped executor (followers replay on it)
    bcast_seconds: float = 0.0  # leader: wall time spent broadcasting commands (benchmarks report it)
    num_calls: int = 0  # executor calls run on this rank (a follower's count equals its leader's)
    _stopped: bool = field(default=False, repr=False)

    @property
    def is_leader(self) -> bool:
        return self.mapping.is_leader

    def leaders_allreduce(self, value: int) -> int:
        """The DP lockstep busy check: sum over the leaders (armed by the watchdog)."""
        with self.dog.guard("lockstep busy check (allreduce over the DP leaders)", mpi=True):
            return int(self.leaders_comm.allreduce(value))

    def follow(self) -> None:
        """Follower: receive the leader's executor calls, run them, discard the outputs, until STOP."""
        assert not self.is_leader
        dog, comm, ex = self.dog, self.tp_comm, self.executor
        leader = self.mapping.rank - self.mapping.tp_rank
        last: str | None = None  # None: between steps, the wait may be idle and is not armed
        while True:
            if last is None:
                with dog.mpi_wait():
                    msg = comm.bcast(None, root=0)
            else:
                with dog.guard(f"the wait for rank {leader}'s next call after the {last}", mpi=True):
                    msg = comm.bcast(None, root=0)
            kind = msg[0]
            if kind == CALL:
                _, method, inp, dog.step = msg
                last = CALL_NAMES[method]
                self.num_calls += 1
                with dog.guard(last):
                    if method == "run_main":
                        dog.maybe_stall()
                    getattr(ex, method)(inp)
            elif kind == STEP_END:
                last = None
            elif kind == STOP:
                self._stopped = True
                return
            else:  # pragma: no cover - the leader only sends the kinds above
                raise RuntimeError(f"unknown TP command {kind!r}")

    def stop(self) -> None:
        """Leader: release the followers from follow() (idempotent; a no-op without followers)."""
        if self.is_leader and self.tp_comm is not None and not self._stopped:
            self._stopped = True
            self.tp_comm.bcast((STOP,), root=0)


class LeaderExecutor:
    """The executor a leader (or a rank without TP) steps: arms the watchdog around each call and, with
    followers, broadcasts the call before running it locally (so the collectives inside line up)."""

    def __init__(self, role: RankRole) -> None:
        self.role, self.inner = role, role.executor
        self.hidden_size, self.vocab_size = self.inner.hidden_size, self.inner.vocab_size

    def __getattr__(self, name: str) -> Any:  # config, plans, ...: whatever the wrapped executor exposes
        return getattr(self.inner, name)

    def _call(self, method: str, inp: Any) -> Any:
        role, dog = self.role, self.role.dog
        role.num_calls += 1
        with dog.guard(CALL_NAMES[method]):
            if role.tp_comm is not None:
                t0 = time.perf_counter()
                role.tp_comm.bcast((CALL, method, inp, dog.step), root=0)
                role.bcast_seconds += time.perf_counter() - t0
            if method == "run_main":
                dog.maybe_stall()
            return getattr(self.inner, method)(inp)

    def run_main(self, inp):
        return self._call("run_main", inp)

    def run_draft(self, inp):
        return self._call("run_draft", inp)

    def run_commit(self, inp):
        return self._call("run_commit", inp)

    def copy_blocks(self, pairs):
        return self._call("copy_blocks", pairs)


def run_follower(role: RankRole, prog: str, debug: bool = False) -> int:
    """A follower's whole life after start-up: follow until STOP; a local failure ends the job (one line)."""
    # A follower's life is driven by its leader: it leaves on STOP, or the launcher ends it when the leader
    # exits. Ctrl-C / SIGTERM forwarded by mpirun must not kill it mid-drain (the serving leader drains, then
    # sends STOP); blocked in MPI it could not run a Python handler anyway, so the signals are ignored.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        role.follow()
    except BaseException as e:  # noqa: BLE001 - the leader cannot be told: end the job
        exit_failed_rank(role.mapping.rank, e, prog, debug, code=130 if isinstance(e, KeyboardInterrupt) else 1)
    return 0
