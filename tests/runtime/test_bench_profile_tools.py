"""The profile tools' pure parts: runtime/bench/compiled_compare.py `step_inputs` for a hybrid engine (what
compiled_profile and decode_pieces time: its state slots follow runtime/core/state_pool.py's rules, so repeating the
timed step repeats the same work on a real state) and decode_pieces' reading of the ordered ops. Nothing here is timed."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.bench.compiled_compare import step_inputs
from runtime.executors.base import HybridMainInput, MainInput


@pytest.mark.parametrize(("batch", "rows"), [(1, 1), (1, 4), (3, 2)])
def test_hybrid_step_reads_the_prefills_state_and_never_writes_a_slot_it_reads(batch, rows):
    prefills, step, _ = step_inputs(batch, rows, 20, 16, 8, 100, hybrid=True)
    assert all(isinstance(p, HybridMainInput) for p in [*prefills, step])
    for r, p in enumerate(prefills):
        assert p.positions[0] == 0  # fresh: the slot it names is not read
        assert (p.state_write_slots[:-1] == -1).all()  # a prefill stores its last row's state only
        assert p.state_write_slots[-1] == step.state_read_slots[r]  # ... which the step starts from
    writes = step.state_write_slots.reshape(batch, rows)
    assert (writes >= 0).all() and len(np.unique(writes)) == writes.size  # one slot per row, none shared
    assert not np.isin(step.state_read_slots, writes).any()  # no row writes a slot the forward reads


def test_a_plain_engine_gets_plain_inputs():
    prefills, step, _ = step_inputs(2, 2, 20, 16, 8, 100)
    assert type(step) is MainInput and all(type(p) is MainInput for p in prefills)


def test_decode_pieces_reads_a_gdn_layer_an_attention_layer_and_the_head_in_their_order():
    """runtime/bench/decode_pieces.py: each op of a hybrid decode forward, in the engine's order, lands in its piece."""
    from runtime.bench.decode_pieces import LayerCursor, piece_of

    h = 2048
    gdn = [("mtp::linear_bf16", (8192, h), "in_proj qkv"), ("mtp::linear_bf16", (32, h), "in_proj b, a"),
           ("mtp::gdn_step", None, "gdn_step"), ("mtp::linear_bf16", (4096, h), "in_proj z"),
           ("mtp::linear_bf16", (h, 4096), "out_proj")]  # fmt: skip
    attn = [("mtp::linear_bf16", (8192, h), "q_proj"), ("mtp::linear_bf16", (512, h), "k_proj"),
            ("mtp::paged_attention", None, "paged_attention"), ("mtp::linear_bf16", (h, 4096), "o_proj")]  # fmt: skip
    moe = [("mtp::linear_bf16", (32, h), "router"), ("mtp::moe_experts", None, "routed experts"),
           ("mtp::linear_bf16", (1, h), "shared expert"), ("mtp::linear_bf16", (512, h), "shared expert"),
           ("mtp::linear_bf16", (h, 512), "shared expert")]  # fmt: skip
    at = LayerCursor()
    for op, weight, want in [*gdn, *moe, *attn, *moe, ("mtp::linear_bf16", (h, h), "lm_head")]:
        assert want in piece_of(op, weight, h, at), (op, weight)
