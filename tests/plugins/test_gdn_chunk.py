"""The chunked form of `mtp::gdn_step` (plugins/csrc/gdn_chunk.h): a run of prompt rows that store no state goes
through the state once per 32-row chunk. It equals transformers' `torch_chunk_gated_delta_rule` and the row-by-row
definition (plugins/reference.py `gdn_step_ref`, and the op's own row-by-row form) within fp32 tolerance, for runs
shorter than a chunk, runs crossing chunk boundaries, runs cut by rows storing their state, and packed batches mixing prefill, verify and decode rows; it
is thread-count invariant; and the comparison catches one chunk's decay being off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import plugins.gdn_ops  # noqa: F401  (torch.ops.mtp.gdn_step)
from plugins.cpp_ops import cpu_isa, gdn_chunk_min_run
from plugins.gdn_pool import GDNPoolGeometry, address
from plugins.reference import gdn_step_ref
from tests.plugins.conftest import HAS_AVX2

HK, DK, HV, DV, K = 2, 16, 4, 20, 4  # Dv 20: the 16-column tiles and a column tail
C = 2 * HK * DK + HV * DV
I32 = torch.int32
TOL = dict(atol=2e-5, rtol=2e-5)


def weights():
    g = torch.Generator().manual_seed(0)
    return (0.3 * torch.randn(C, K, generator=g), 0.5 * torch.randn(HV, generator=g),
            0.5 * torch.randn(HV, generator=g))  # fmt: skip


def rows(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, C, generator=g), torch.randn(n, HV, generator=g), torch.randn(n, HV, generator=g)


def pools(slots=8):
    g = torch.Generator().manual_seed(3)
    return torch.randn(slots, C, K - 1, generator=g), 0.1 * torch.randn(slots, HV, DK, DV, generator=g)


def call(fn, mixed, b, a, counts, starts, reads, writes, conv, ssm):
    """fn (the op or the reference) on the given pools (written in place): the core output [T, Hv, Dv]."""
    w, a_log, dt = weights()
    meta = [torch.tensor(x, dtype=I32) for x in (counts, starts, reads, writes)]
    if fn is gdn_step_ref:
        return gdn_step_ref(mixed, b, a, *meta, conv, ssm, w, a_log, dt, HK, DK, DV)
    geom = GDNPoolGeometry(1, conv.shape[0], C, K, HK, HV, DK, DV)
    return torch.ops.mtp.gdn_step(mixed, b, a, *meta, address(conv), address(ssm), w, a_log, dt, **geom.attrs(0))


def op_and_reference(mixed, b, a, counts, starts, reads, writes):
    """The op (chunked where it applies) and the reference on copies of the same pools: (out, ssm) of each."""
    conv, ssm = pools()
    c1, s1, c2, s2 = conv.clone(), ssm.clone(), conv.clone(), ssm.clone()
    out = call(torch.ops.mtp.gdn_step, mixed, b, a, counts, starts, reads, writes, c1, s1)
    ref = call(gdn_step_ref, mixed, b, a, counts, starts, reads, writes, c2, s2)
    torch.testing.assert_close(c1, c2, atol=1e-6, rtol=1e-6)  # the conv windows are the row-by-row ones
    return (out, s1), (ref, s2)


def test_chunked_prefill_equals_transformers_chunk_rule():
    """A fresh 150-row prompt (chunks of 32, ..., 22), its state stored after the last row == transformers'
    `torch_chunk_gated_delta_rule` over the whole sequence (outputs and the final state)."""
    m = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    assert 1 <= gdn_chunk_min_run() <= 150  # the run below takes the chunked form
    n = 150
    mixed, b, a = rows(n)
    conv, ssm = pools()
    out = call(torch.ops.mtp.gdn_step, mixed, b, a, [n], [0], [0], [-1] * (n - 1) + [5], conv, ssm)
    w, a_log, dt = weights()
    x = m.causal_conv1d_fn(mixed.T[None], w, None, activation="silu").transpose(1, 2)
    q, k, v = torch.split(x, [HK * DK, HK * DK, HV * DV], dim=-1)
    g = -a_log.exp() * F.softplus(a + dt)
    expected, state = m.torch_chunk_gated_delta_rule(
        q.reshape(1, n, HK, DK), k.reshape(1, n, HK, DK), v.reshape(1, n, HV, DV), g=g[None], beta=b.sigmoid()[None],
        chunk_size=32, output_final_state=True, use_qk_l2norm_in_kernel=True)  # fmt: skip
    torch.testing.assert_close(out, expected[0], **TOL)
    torch.testing.assert_close(ssm[5], state[0], **TOL)


@pytest.mark.parametrize("n", [12, 32, 150])
def test_chunked_run_equals_row_by_row_continuing_from_a_slot(n):
    """A prompt chunk continuing from slot 2 (shorter than a chunk, exactly one, crossing four boundaries), the state
    stored after its last row == the reference and == the op's own row-by-row form."""
    mixed, b, a = rows(n, seed=n)
    args = (mixed, b, a, [n], [40], [2], [-1] * (n - 1) + [6])
    (out, ssm), (ref, ref_ssm) = op_and_reference(*args)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(ssm, ref_ssm, **TOL)
    previous = gdn_chunk_min_run()
    try:
        gdn_chunk_min_run(1 << 30)  # row by row everywhere
        conv, row_ssm = pools()
        rows_out = call(torch.ops.mtp.gdn_step, *args, conv, row_ssm)
    finally:
        gdn_chunk_min_run(previous)
    torch.testing.assert_close(out, rows_out, **TOL)
    torch.testing.assert_close(ssm, row_ssm, **TOL)
    assert not torch.equal(out, rows_out)  # the two forms really ran (their sums round differently)


def test_a_prompt_storing_states_at_interior_rows_equals_the_reference():
    """State snapshots inside a prefill chunk (runtime/core/state_pool.py): one request's 150 prompt rows storing their
    state after rows 39, 99, 127 (each ends a chunked run, two of them mid-chunk) and 149 == the reference in every
    stored slot, and the outputs too."""
    mixed, b, a = rows(150, seed=5)
    writes = [-1] * 150
    for row, slot in ((39, 1), (99, 3), (127, 4), (149, 6)):
        writes[row] = slot
    (out, ssm), (ref, ref_ssm) = op_and_reference(mixed, b, a, [150], [0], [0], writes)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(ssm, ref_ssm, **TOL)


@pytest.mark.parametrize("isa", ["generic", "best"] + (["avx2"] if HAS_AVX2 else []))  # each ISA's own tiles
def test_packed_batch_mixing_prefill_verify_and_decode_rows(isa):
    """Requests: a fresh 130-row prompt (stored at its last row), a padded one, a 4-row verify (every row stored), a
    70-row prompt continuing from slot 2 that stores at row 30 and at its last (two runs), a 1-row decode."""
    counts, starts, reads = [130, 0, 4, 70, 1], [0, 9, 50, 64, 77], [0, 0, 1, 2, 3]
    writes = [-1] * 129 + [0] + [4, 5, 6, 7] + [-1] * 30 + [1] + [-1] * 38 + [2] + [3]
    mixed, b, a = rows(sum(counts), seed=7)
    previous = cpu_isa()
    try:
        cpu_isa(isa)
        (out, ssm), (ref, ref_ssm) = op_and_reference(mixed, b, a, counts, starts, reads, writes)
    finally:
        cpu_isa(previous)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(ssm, ref_ssm, **TOL)


def test_one_and_two_threads_give_identical_bits():
    counts, starts, reads = [150, 3, 100], [0, 20, 30], [0, 1, 2]
    writes = [-1] * 149 + [3] + [4, 5, 6] + [-1] * 99 + [7]
    mixed, b, a = rows(sum(counts), seed=11)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            conv, ssm = pools()
            results.append((call(torch.ops.mtp.gdn_step, mixed, b, a, counts, starts, reads, writes, conv, ssm), ssm))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_verify_and_decode_rows_keep_their_bits_when_prompt_runs_are_chunked():
    """The chunked form (FMA on AVX-512) changes only the prompt runs' rows: in a batch with a prompt, a verify and a
    decode request, the verify and decode rows, their stored states and every conv window are bit-identical with the
    chunked form on and off, while the prompt's rows do differ (the check can fail)."""
    counts, starts, reads = [100, 4, 1], [0, 50, 77], [0, 1, 3]
    writes = [-1] * 99 + [0] + [4, 5, 6, 7] + [2]
    mixed, b, a = rows(sum(counts), seed=13)
    results = []
    previous = gdn_chunk_min_run()
    try:
        for min_run in (previous, 1 << 30):
            gdn_chunk_min_run(min_run)
            conv, ssm = pools()
            results.append((call(torch.ops.mtp.gdn_step, mixed, b, a, counts, starts, reads, writes, conv, ssm), conv,
                            ssm))  # fmt: skip
    finally:
        gdn_chunk_min_run(previous)
    (chunked, conv1, ssm1), (by_row, conv2, ssm2) = results
    assert torch.equal(chunked[100:], by_row[100:]) and torch.equal(ssm1[2:], ssm2[2:]) and torch.equal(conv1, conv2)
    assert not torch.equal(chunked[:100], by_row[:100])


def test_one_chunk_with_its_decay_off_is_caught():
    """The comparison can fail: the reference with the decay logits of one chunk (the last, rows 128..149) off by 0.02
    differs from the op beyond the tolerance, in that chunk's outputs and in the stored state (the chunks before it
    still agree)."""
    n = 150
    mixed, b, a = rows(n)
    off = a.clone()
    off[128:] += 0.02
    conv, ssm = pools()
    out = call(torch.ops.mtp.gdn_step, mixed, b, a, [n], [40], [2], [-1] * (n - 1) + [6], conv, ssm)
    conv, bad_ssm = pools()
    bad = call(gdn_step_ref, mixed, b, off, [n], [40], [2], [-1] * (n - 1) + [6], conv, bad_ssm)
    torch.testing.assert_close(out[:128], bad[:128], **TOL)  # the chunks before it still agree
    with pytest.raises(AssertionError):
        torch.testing.assert_close(out[128:], bad[128:], **TOL)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(ssm[6], bad_ssm[6], **TOL)


def test_bad_min_run_is_one_line_value_error():
    with pytest.raises(ValueError, match=r"gdn_chunk_min_run: 0 is not a run length") as err:
        gdn_chunk_min_run(0)
    assert "\n" not in str(err.value).strip()
