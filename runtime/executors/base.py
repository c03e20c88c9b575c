"""The executor contract: three calls on per-step arrays (docs/ARCHITECTURE.md).

The runtime's scheduling and MTP logic never knows which executor runs: it hands over numpy arrays
in these dataclasses and gets numpy arrays back. Executors own the KV pool (allocated once, at a
stable address) and the model/engine; they never own blocks (runtime/core/kv_manager.py does).

Shapes: T packed main rows, R requests in the forward, N commit rows, H hidden, V vocab, MB max blocks.
Padding: a request with count 0 and block table row of -1 (or the null block 0) reads and writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(slots=True)
class MainInput:
    input_ids: np.ndarray  # int64 [T] packed tokens, request by request
    positions: np.ndarray  # int64 [T] position of each token
    q_counts: np.ndarray  # int32 [R] rows of each request (0 = padded request)
    kv_lens: np.ndarray  # int32 [R] KV length of each request after this step's append
    block_tables: np.ndarray  # int32 [R, MB]
    logit_rows: np.ndarray  # int64 [N] rows whose logits are needed (sampling / verification)


@dataclass(slots=True)
class HybridMainInput(MainInput):
    """MainInput of a hybrid (Gated DeltaNet) model: plus the recurrent-state slots (runtime/core/state_pool.py)."""

    state_read_slots: np.ndarray  # int32 [R] slot each request's state starts from
    state_write_slots: np.ndarray  # int32 [T] slot receiving the state after each row, -1 = not stored


@dataclass(slots=True)
class MainOutput:
    hidden: np.ndarray  # float32 [T, H] post-final-norm hidden of every row (feeds the MTP module)
    logits: np.ndarray  # float32 [N, V] logits of `logit_rows`


@dataclass(slots=True)
class DraftInput:
    hidden_in: np.ndarray  # float32 [R, H] main hidden at base-1 (depth 0) or previous depth's output
    token_ids: np.ndarray  # int64 [R] base token (depth 0) or previous depth's draft
    positions: np.ndarray  # int64 [R] MTP write position base-1+d
    counts: np.ndarray  # int32 [R] 1 = live, 0 = padded row
    block_tables: np.ndarray  # int32 [R, MB]
    depth: int = 0  # draft depth d: which MTP module runs it (`draft_module`); not a graph input


@dataclass(slots=True)
class FusedDraftInput:
    """The K draft depths in one call (compiled engines: builder/fused_draft.py): depth 0's DraftInput fields plus
    each row's draft count; a row at depth d >= depths[r] writes only the null block."""

    hidden_in: np.ndarray  # float32 [R, H] main hidden at base-1
    token_ids: np.ndarray  # int64 [R] base token
    positions: np.ndarray  # int64 [R] depth 0's MTP write position, base-1
    counts: np.ndarray  # int32 [R] 1 = live, 0 = padded row (only after the live rows: the KV write packs by counts)
    block_tables: np.ndarray  # int32 [R, MB]
    depths: np.ndarray  # int64 [R] k_i: the depths whose drafts and KV writes count


MTP_MODULE_POLICIES = ("per-depth", "first")


def draft_module(depth: int, num_modules: int, policy: str = "per-depth") -> int:
    """The MTP module that runs draft depth `depth`: "per-depth" = module d at depth d (MiMo-V2-Flash's three modules),
    the last module again at depths past it; "first" = module 0 at every depth (the serial chain; an ablation for
    multi-module checkpoints). Single-module models: module 0 either way."""
    return 0 if policy == "first" else min(depth, max(num_modules, 1) - 1)


@dataclass(slots=True)
class DraftOutput:
    hidden_out: np.ndarray  # float32 [R, H] chained hidden (after shared_head.norm)
    logits: np.ndarray  # float32 [R, V]


@dataclass(slots=True)
class CommitInput:
    hidden_in: np.ndarray  # float32 [N, H] main hiddens h_p, packed by request
    token_ids: np.ndarray  # int64 [N] t_{p+1} for each row
    counts: np.ndarray  # int32 [R] one segment per active request (0 allowed)
    starts: np.ndarray  # int32 [R] position of each segment's first row
    block_tables: np.ndarray  # int32 [R, MB]


class Executor(Protocol):
    """What the runtime needs from a backend (torch, onnxruntime, tensorrt)."""

    hidden_size: int
    vocab_size: int

    def run_main(self, inp: MainInput) -> MainOutput: ...

    def run_draft(self, inp: DraftInput) -> DraftOutput: ...

    def run_commit(self, inp: CommitInput) -> int: ...

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy every plane of block src to block dst (prefix-cache copy-on-write)."""
        ...
