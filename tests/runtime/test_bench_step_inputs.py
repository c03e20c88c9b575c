"""runtime/bench/compiled_compare.py `step_inputs` for a hybrid engine (what compiled_profile times): the state slots
follow runtime/core/state_pool.py's rules, so repeating the timed step repeats the same work on a real state. Pure
numpy; nothing here is timed."""

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
