"""The rank strategies an engine is constructed with under mpirun (docs/ARCHITECTURE.md §8).

Chosen once at start-up by `rank_strategy`, before the engine exists; the engine then only calls the hooks of
runtime/core/ranks.py `RankStrategy`. Nothing outside the engine assigns to the engine.

* `Lockstep`   a rank that runs the engine in a multi-rank job: executor calls armed by the watchdog; with several DP
               groups the busy check and the draft-length agreement over the leaders comm, dummy forwards when idle
               (invariant 9)
* `TPLeader`   a TP group's leader: a `Lockstep` (when there are several DP groups) whose executor broadcasts every
               call to the followers first and whose steps are announced to them
* `TPFollower` a TP follower: never steps an engine; `follow` replays the leader's calls until STOP
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from models.config import ModelConfig
from plugins.mapping import Parallel, rank_mapping
from runtime.core.config import ConfigError, RuntimeConfig
from runtime.core.ranks import SINGLE_RANK, RankStrategy
from runtime.executors.base import Executor
from runtime.multirank.fingerprint import settings_fingerprint
from runtime.multirank.host_facts import host_facts
from runtime.multirank.parallel import agree_on_settings, mpi_world
from runtime.multirank.peer_probe import PeerProbe, blame, exchange_contacts
from runtime.multirank.tp_group import STEP_END, LeaderExecutor, RankRole, run_follower
from runtime.multirank.watchdog import Watchdog, startup_timeout


class Lockstep(RankStrategy):
    """A rank that steps the engine in a multi-rank job; lockstep with the other DP groups when there are any."""

    def __init__(self, role: RankRole) -> None:
        self.role = role
        m = role.mapping
        self.lockstep = m.dp > 1  # with one DP group the followers replay whatever the leader runs
        self.dp_rank, self.dp_size = m.dp_rank, m.dp

    def executor(self, executor: Executor) -> Executor:
        """Every call armed by the watchdog (the MoE exchange inside is a collective); a TP leader's also broadcast."""
        return LeaderExecutor(self.role)

    def begin_step(self) -> None:
        self.role.dog.step += 1

    def any_busy(self, busy: bool) -> bool:
        return bool(self.role.leaders_allreduce(int(busy))) if self.lockstep else busy

    def gather_draft_samples(self, sample: np.ndarray) -> list[np.ndarray]:
        if not self.lockstep:
            return [sample]
        with self.role.dog.guard("draft-length agreement (allgather over the DP leaders)", mpi=True):
            return self.role.leaders_comm.allgather(sample)

    def gather_to_first(self, value: Any) -> list[Any] | None:
        return self.role.leaders_comm.gather(value, root=0) if self.lockstep else [value]

    def on_collective_timeout(self, fn: Callable[[str], None]) -> None:
        self.role.dog.on_fire(fn)


class TPLeader(Lockstep):
    """Leader of a TP group: every executor call is broadcast to the followers, and each step's end announced."""

    def end_step(self) -> None:
        role = self.role
        if role.tp_comm is not None and not role._stopped:
            role.tp_comm.bcast((STEP_END, role.dog.step), root=0)

    def stop(self) -> None:
        self.role.stop()


class TPFollower(RankStrategy):
    """A TP follower: replays the leader's executor calls on its shards; the apps call `follow`, never step()."""

    is_follower = True

    def __init__(self, role: RankRole) -> None:
        self.role = role
        self.dp_rank, self.dp_size = role.mapping.dp_rank, role.mapping.dp

    def follow(self, prog: str, debug: bool = False) -> int:
        return run_follower(self.role, prog, debug)


def rank_strategy(executor: Executor, model_cfg: ModelConfig, cfg: RuntimeConfig, parallel: Parallel,
                  collective_timeout: float, prog: str) -> RankStrategy:  # fmt: skip
    """This rank's strategy (every rank calls this once, at start-up; SINGLE_RANK outside mpirun).

    Agrees on the settings over COMM_WORLD first (RanksDisagree on every rank), then makes the TP and column
    communicators (a collective: plugins/collectives.py `groups`, shared with the collective plugin ops).
    """
    comm, rank, world = mpi_world()
    if comm is None or world == 1:
        return SINGLE_RANK
    from plugins.collectives import groups  # lazy: imports torch

    m = rank_mapping(rank, parallel, model_cfg.n_routed_experts if model_cfg.has_moe else 0)
    if m.world != world:
        raise ConfigError(f"the mapping is for world_size={m.world} but {world} rank(s) were launched: "
                          f"use mpirun -np {m.world}")  # fmt: skip
    # The start-up collectives are bounded too (issue 31: a split that never returns across two hosts that share
    # one hostname), by the longer start-up bound: here a rank also waits for the slowest rank's load.
    dog, bound = Watchdog(collective_timeout, rank, prog), startup_timeout(collective_timeout)
    with dog.guard("communicator split (MPI_Comm_split over every rank)", bound, mpi=True):
        tp, column = groups(m.tp)
        # Commands travel on their own copy of the TP comm, so they never interleave with the forwards' collectives.
        commands = tp.Dup() if m.tp > 1 else None
    launch = {"parallel.world_size": m.world, "parallel.tp_size": m.tp, "parallel.ep_size": m.ep,
              "watchdog.collective_timeout": collective_timeout, **host_facts(_has_packages(executor))}  # fmt: skip
    with dog.guard("settings agreement (allgather over every rank)", bound, mpi=True):
        agree_on_settings(comm, settings_fingerprint(executor, model_cfg, cfg, launch))
        contacts = exchange_contacts(comm, PeerProbe(rank, dog.status))  # so a firing watchdog can name the peer
    dog.blame = lambda: blame(contacts, rank)
    role = RankRole(m, commands, column, dog, executor)
    if not m.is_leader:
        return TPFollower(role)
    return TPLeader(role) if m.tp > 1 else Lockstep(role)


def _has_packages(executor: Executor) -> bool:
    """The engine has compiled packages, native code for one CPU ISA: then every host must have that ISA (a host
    without it would fall back to another executor, or fail)."""
    from models.engine_format.compiled import compiled_info

    cfg = getattr(executor, "config", None)
    return cfg is not None and hasattr(cfg, "build") and compiled_info(cfg) is not None


def lead_or_follow(ranks: RankStrategy, lead, prog: str, debug: bool = False) -> int:
    """Every app's multi-rank entry (mtp-run, mtp-serve, the benches): a follower replays its leader's calls
    until STOP; a leader (or a rank alone) runs `lead()` and then releases its followers, whatever ended it."""
    if isinstance(ranks, TPFollower):
        return ranks.follow(prog, debug)
    try:
        return lead()
    finally:
        ranks.stop()
