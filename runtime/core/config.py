"""RuntimeConfig: the serving limits and MTP switches of one engine instance (validated on creation)."""

from __future__ import annotations

from dataclasses import dataclass

from models.config import ConfigError  # one error type for every bad configuration
from models.engine_format.layout import SNAPSHOTS_PER_REQUEST, table_width
from runtime.executors.base import MTP_MODULE_POLICIES

__all__ = ["DEFAULT_DRAFT_TOKENS", "ConfigError", "RuntimeConfig"]

# --num-draft-tokens when none is given (mtp-run, mtp-serve, the LLM API, the benches: all through create_engine):
# each request its own k_i <= the engine's built K per step, priced by the profiled cost model (verify_lengths.py)
DEFAULT_DRAFT_TOKENS = "per-request"

# Hybrid prefix caching: a long prompt's hit can resume this close to its shared prefix's end (docs/MODELS.md "Prefix
# caching through state snapshots": 128 puts a 2,000-token prefix's hit past 90%, 256 falls short at 89.6%)
DEFAULT_SNAPSHOT_INTERVAL = 128


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    max_batch: int = 8  # requests in flight
    max_num_tokens: int = 256  # packed main rows per step (token budget)
    max_seq_len: int = 512  # prompt + output tokens per request
    block_size: int = 16  # KV block size in tokens
    num_blocks: int = 256  # KV pool blocks, block 0 reserved
    num_draft_tokens: int = 3  # k MTP draft depths; 0 disables MTP (with auto_draft_tokens: the maximum)
    auto_draft_tokens: bool = False  # --num-draft-tokens auto: pick k <= num_draft_tokens per step (draft_length.py)
    # --num-draft-tokens per-request: each request its own k_i <= num_draft_tokens per step (verify_lengths.py)
    per_request_draft_tokens: bool = False
    max_prefill_chunk: int = 256  # longest prefill chunk per step (chunked prefill)
    enable_prefix_caching: bool = True
    # Prefix hit under MTP: False = give up the last matched block (the anchors' rule); True = keep it and
    # recompute only its last token in a copy-on-write private copy (saves B-1 tokens of prefill per hit).
    prefix_cache_cow: bool = False
    # Hybrid (Gated DeltaNet) models: recurrent-state snapshot slots kept for prefix caching (runtime/core/
    # state_snapshots.py); None = SNAPSHOTS_PER_REQUEST per request of max_batch (each costs one request's state)
    num_state_snapshots: int | None = None
    # ... and the prompt tokens between two of them inside a forward, beside its last block boundary (a multiple of
    # block_size; 0 = that last boundary only); None = DEFAULT_SNAPSHOT_INTERVAL rounded up to whole blocks
    state_snapshot_interval: int | None = None
    commit_pass: bool = True  # False = ablation: skip the decode refresh of the MTP plane (measurement only)
    # Models with several MTP modules (MiMo-V2-Flash): "per-depth" = depth d runs module d (past the last module: the
    # last again); "first" = module 0 at every depth (runtime/executors/base.py draft_module)
    mtp_modules: str = "per-depth"
    # The draft loop's K depths in one call where the compiled engine has the package and every row drafts by argmax
    # (runtime/core/draft_loop.py); False = one call per depth always (measurement: docs/PERFORMANCE.md)
    fused_draft: bool = True

    def __post_init__(self) -> None:
        k = self.num_draft_tokens
        checks = [
            (self.max_batch >= 1, f"max_batch={self.max_batch}: must be >= 1"),
            (k >= 0, f"num_draft_tokens={k}: must be >= 0 (0 disables MTP)"),
            (k < self.block_size, f"num_draft_tokens={k} must be < block_size={self.block_size}"),
            (self.max_num_tokens >= self.max_batch * (1 + k),
             f"max_num_tokens={self.max_num_tokens} < max_batch*(1+k)={self.max_batch * (1 + k)}: "
             "raise max_num_tokens or lower max_batch / num_draft_tokens"),
            (not (self.auto_draft_tokens and self.per_request_draft_tokens),
             "num_draft_tokens: choose one of auto and per-request"),
            (self.max_prefill_chunk >= 1, f"max_prefill_chunk={self.max_prefill_chunk}: must be >= 1"),
            (self.num_state_snapshots is None or self.num_state_snapshots >= 0,
             f"num_state_snapshots={self.num_state_snapshots}: must be >= 0 (0 turns hybrid prefix caching off)"),
            (self.state_snapshot_interval is None or (self.state_snapshot_interval >= 0
                                                       and self.state_snapshot_interval % self.block_size == 0),
             f"state_snapshot_interval={self.state_snapshot_interval}: must be a multiple of block_size="
             f"{self.block_size} (0: only the last block boundary of each forward)"),
            (self.num_blocks >= 2, f"num_blocks={self.num_blocks}: need at least 2 (block 0 is reserved)"),
            (self.mtp_modules in MTP_MODULE_POLICIES,
             f"mtp_modules={self.mtp_modules!r}: choose one of {', '.join(MTP_MODULE_POLICIES)}"),
        ]  # fmt: skip
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)

    @property
    def state_snapshot_slots(self) -> int:
        """Snapshot slots a hybrid model's state pool gets beyond its max_batch x (K+2) request slots."""
        if not self.enable_prefix_caching:
            return 0
        default = SNAPSHOTS_PER_REQUEST * self.max_batch
        return default if self.num_state_snapshots is None else self.num_state_snapshots

    @property
    def snapshot_interval(self) -> int:
        """Prompt tokens between two state snapshots one forward stores (runtime/core/state_pool.py); 0 = none."""
        if self.state_snapshot_interval is not None:
            return self.state_snapshot_interval
        return -(-DEFAULT_SNAPSHOT_INTERVAL // self.block_size) * self.block_size

    @property
    def max_blocks_per_request(self) -> int:
        """Block-table width: max_seq_len plus the draft lookahead, by the engine format's one width function."""
        return table_width(self.max_seq_len, self.num_draft_tokens, self.block_size)
