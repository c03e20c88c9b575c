"""Which part of the model and which communicators a rank has: `RankMapping`, built by one pure function.

The tensor-parallel mapping contract (docs/ARCHITECTURE.md §8, "Mappings"): `parallel = {world_size W,
ep_size EP, tp_size TP}` in config.json; dp_size = W // TP; rank = dp_rank * TP + tp_rank (a TP group is TP
consecutive ranks, its leader tp_rank 0); with TP == 1, EP in {1, W}; with TP > 1, EP in {TP, W} (routed
experts are always split over the TP group: replicated experts would be double-counted by the TP all-reduce);
ep_rank = tp_rank * (EP // TP) + (dp_rank if EP == W else 0) and the rank holds global experts
[ep_rank * E/EP, (ep_rank + 1) * E/EP).

Everything here is derived from (rank, Parallel): config.json stores only `parallel`, never a per-rank table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Parallel:
    """The whole mapping of a job, as config.json records it (`parallel`)."""

    world_size: int
    ep_size: int
    tp_size: int


class MappingError(ValueError):
    """A (world, ep, tp) combination or rank that the contract does not allow; the message names the fix."""


@dataclass(frozen=True, slots=True)
class RankMapping:
    rank: int
    world: int
    tp: int  # tensor-parallel group size
    ep: int  # expert-parallel size (ranks the routed experts are split over)
    dp: int  # data-parallel groups = world // tp
    dp_rank: int  # which TP group (= which schedule) this rank belongs to
    tp_rank: int  # position inside the TP group; 0 = the group's leader
    ep_rank: int  # which expert slice this rank holds
    num_experts: int  # global routed experts E (0: dense model)
    expert_lo: int  # this rank holds global experts [expert_lo, expert_hi)
    expert_hi: int

    @property
    def experts_per_rank(self) -> int:
        return self.expert_hi - self.expert_lo

    @property
    def is_leader(self) -> bool:
        """The TP group's leader: runs the schedule; the other ranks replay its executor calls."""
        return self.tp_rank == 0

    @property
    def column_lo(self) -> int:
        """First global expert of this rank's column (tp_rank t owns [t*E/TP, (t+1)*E/TP) across its column)."""
        return self.tp_rank * (self.num_experts // self.tp) if self.num_experts else 0

    @property
    def exchanges_experts(self) -> bool:
        """Whether the routed experts' tokens travel over the column comm (EP == W and more than one rank in it)."""
        return self.ep > self.tp


def _flag(name: str, flags: bool) -> str:
    """Name a setting as the caller knows it: `--tp-size` for mtp-build, `tp_size` for config.json."""
    return "--" + name.replace("_", "-") if flags else name


def check_parallel(world: int, ep: int, tp: int, flags: bool = False) -> None:
    """Raise MappingError (one line, naming the fix) unless (W, EP, TP) is a mapping the contract allows."""
    w, e, t = (_flag(n, flags) for n in ("world_size", "ep_size", "tp_size"))
    for name, value in ((w, world), (e, ep), (t, tp)):
        if value < 1:
            raise MappingError(f"{name} must be >= 1, got {value}")
    if world % tp:
        raise MappingError(f"{t} {tp} must divide {w} {world} (each TP group is {t} consecutive ranks)")
    if tp == 1:
        if world % ep:
            raise MappingError(f"{e} {ep} must divide {w} {world}")
        if ep not in (1, world):
            raise MappingError(f"{e} {ep} with {t} 1 must be 1 (replicated experts) or {w} ({world})")
    elif ep not in (tp, world):
        raise MappingError(
            f"{e} {ep} with {t} {tp} must be {t} ({tp}) or {w} ({world}): routed experts are always split over "
            "the TP group"
        )


def local_kv_heads(num_kv_heads: int, tp: int) -> int:
    """KV heads one TP rank holds (and its KV pool stores): split when >= tp, else the one its q heads use."""
    return num_kv_heads // tp if num_kv_heads >= tp else 1


def check_model(world: int, ep: int, tp: int, *, num_experts: int, num_heads: int, num_kv_heads: int,
                vocab_size: int, mla: bool = False, inter_sizes: tuple[int, ...] = (), gdn_key_heads: int = 0,
                flags: bool = False) -> None:  # fmt: skip
    """The model-dependent rules of the contract (after `check_parallel`); one-line MappingError.

    `inter_sizes`: the dense MLP and shared-expert intermediate sizes (column-parallel: must split over tp).
    `mla`: attention heads split over tp, the latent (one KV row per position) replicated: no KV-head rule.
    `gdn_key_heads`: a hybrid model's Gated DeltaNet key heads (0: none); its layers split by key head and the value
    heads grouped under each (models/sharding.py), so tp must divide them.
    """
    check_parallel(world, ep, tp, flags)
    e, t = _flag("ep_size", flags), _flag("tp_size", flags)
    if num_experts and num_experts % ep:
        raise MappingError(f"n_routed_experts={num_experts} does not split over {e} {ep}; choose an ep size "
                           "that divides the expert count")  # fmt: skip
    if tp == 1:
        return
    if gdn_key_heads % tp:
        raise MappingError(f"linear_num_key_heads={gdn_key_heads} does not split over {t} {tp} (Gated DeltaNet layers "
                           "split by key head, with its value heads); choose a tp size that divides it")  # fmt: skip
    if num_heads % tp:
        raise MappingError(f"num_attention_heads={num_heads} does not split over {t} {tp}; choose a tp size "
                           "that divides the head count")  # fmt: skip
    kv_heads = 0 if mla else num_kv_heads  # MLA: one latent KV row per position, the same on every rank
    if kv_heads >= tp and kv_heads % tp:
        raise MappingError(f"num_key_value_heads={num_kv_heads} does not split over {t} {tp}; choose a tp size "
                           "that divides it (or a multiple of it: KV heads are then replicated)")  # fmt: skip
    if 0 < kv_heads < tp and tp % kv_heads:
        raise MappingError(f"num_key_value_heads={num_kv_heads} cannot be replicated over {t} {tp}; choose a tp "
                           "size that is a multiple of the KV head count")  # fmt: skip
    if vocab_size % tp:
        raise MappingError(f"vocab_size={vocab_size} does not split over {t} {tp} (vocab-parallel embedding and "
                           "lm_head); choose a tp size that divides it")  # fmt: skip
    for inter in inter_sizes:
        if inter % tp:
            raise MappingError(f"MLP intermediate size {inter} does not split over {t} {tp} (column-parallel "
                               "gate/up); choose a tp size that divides it")  # fmt: skip


def rank_mapping(rank: int, parallel: Parallel, num_experts: int = 0) -> RankMapping:
    """The mapping of `rank` under `parallel` (validated); `num_experts` = the model's routed experts (0: dense)."""
    world, ep, tp = parallel.world_size, parallel.ep_size, parallel.tp_size
    check_parallel(world, ep, tp)
    if not 0 <= rank < world:
        raise MappingError(f"rank {rank} is outside world_size {world}")
    if num_experts and num_experts % ep:
        raise MappingError(f"n_routed_experts={num_experts} does not split over ep_size {ep}")
    dp = world // tp
    dp_rank, tp_rank = divmod(rank, tp)
    ep_rank = tp_rank * (ep // tp) + (dp_rank if ep == world else 0)
    per = num_experts // ep if num_experts else 0
    return RankMapping(rank=rank, world=world, tp=tp, ep=ep, dp=dp, dp_rank=dp_rank, tp_rank=tp_rank,
                       ep_rank=ep_rank, num_experts=num_experts, expert_lo=ep_rank * per,
                       expert_hi=(ep_rank + 1) * per)  # fmt: skip


def single_rank() -> RankMapping:
    """The mapping of a one-rank engine (everything local)."""
    return rank_mapping(0, Parallel(1, 1, 1))
