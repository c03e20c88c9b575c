"""The onnxruntime executor on a built engine reproduces the torch executor (outputs and every KV plane)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.checkpoint import load_model
from models.engine_format import EngineDirError
from runtime.executors.base import CommitInput, DraftInput, MainInput
from runtime.executors.ort_executor import OrtExecutor
from runtime.executors.torch_executor import TorchExecutor

TOL = 1e-4
MB = 17  # block table width: ceil((max_seq_len 64 + 2K) / block size 4)


def _tables(rng: np.random.Generator, n_requests: int, n_blocks: int) -> np.ndarray:
    """Disjoint random blocks per request (block 0 is the null block), -1 padded."""
    ids = rng.permutation(np.arange(1, n_blocks))[: n_requests * 4].reshape(n_requests, 4)
    tables = np.full((n_requests, MB), -1, np.int32)
    tables[:, :4] = ids
    return tables


@pytest.fixture(scope="module")
def executors(engine, checkpoint):
    ort_ex = OrtExecutor(engine, num_blocks=40)
    model, _ = load_model(checkpoint)
    return ort_ex, TorchExecutor(model, num_blocks=40, block_size=4)


def _close(a: np.ndarray, b: np.ndarray, what: str) -> None:
    assert a.shape == b.shape, what
    np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL, err_msg=what)


def test_ort_matches_torch_on_mixed_batch(executors):
    check_ort_matches_torch(*executors, mtp_plane=2)


def check_ort_matches_torch(ort_ex: OrtExecutor, torch_ex: TorchExecutor, mtp_plane: int) -> None:
    """A mixed prefill/verify/padded batch, a commit write and two draft depths: every output and every KV
    plane of the ORT engine equals the torch executor's (also used for the MLA engines, test_mla_engine.py)."""
    rng = np.random.default_rng(7)
    tables = _tables(rng, 3, 40)
    # Step 1: prefill chunks for three requests (5, 6, 3 tokens).
    lens = [5, 6, 3]
    step1 = MainInput(
        input_ids=rng.integers(0, 96, sum(lens)), positions=np.concatenate([np.arange(n) for n in lens]),
        q_counts=np.array(lens, np.int32), kv_lens=np.array(lens, np.int32), block_tables=tables,
        logit_rows=np.array([4, 10, 13]),
    )  # fmt: skip
    # Step 2: request 0 prefills its next chunk (5..7), request 1 verifies base + 2 drafts (6..8), request 2 is
    # a padded row (count 0, table -1): a mixed prefill/decode packed batch.
    tables2 = tables.copy()
    tables2[2] = -1
    step2 = MainInput(
        input_ids=rng.integers(0, 96, 6), positions=np.array([5, 6, 7, 6, 7, 8]),
        q_counts=np.array([3, 3, 0], np.int32), kv_lens=np.array([8, 9, 0], np.int32), block_tables=tables2,
        logit_rows=np.array([2, 3, 4, 5]),
    )  # fmt: skip
    for i, step in enumerate([step1, step2]):
        a, b = ort_ex.run_main(step), torch_ex.run_main(step)
        _close(a.hidden, b.hidden, f"main hidden, step {i}")
        _close(a.logits, b.logits, f"main logits, step {i}")
    hidden = torch_ex.run_main(step2).hidden  # same positions rewritten with the same values: idempotent
    commit = CommitInput(
        hidden_in=np.concatenate([hidden[0:3], hidden[3:4]]), token_ids=rng.integers(0, 96, 4),
        counts=np.array([3, 1, 0], np.int32), starts=np.array([4, 6, 0], np.int32), block_tables=tables2,
    )  # fmt: skip
    assert ort_ex.run_commit(commit) == torch_ex.run_commit(commit) == 4
    draft = DraftInput(
        hidden_in=hidden[[2, 4, 0]], token_ids=rng.integers(0, 96, 3), positions=np.array([7, 7, 0]),
        counts=np.array([1, 1, 0], np.int32), block_tables=tables2,
    )  # fmt: skip
    for depth in range(2):
        a, b = ort_ex.run_draft(draft), torch_ex.run_draft(draft)
        _close(a.hidden_out, b.hidden_out, f"draft hidden, depth {depth}")
        _close(a.logits, b.logits, f"draft logits, depth {depth}")
        draft = DraftInput(a.hidden_out, a.logits.argmax(-1), draft.positions + 1, draft.counts, tables2)
    ort_pool, torch_pool = ort_ex.pool.numpy(), torch_ex.pool.numpy()
    assert np.abs(torch_pool[mtp_plane]).sum() > 0, "the MTP plane was never written"
    for plane in range(ort_pool.shape[0]):
        _close(ort_pool[plane], torch_pool[plane], f"KV plane {plane}")


def test_copy_blocks_copies_every_plane(engine):
    ex = OrtExecutor(engine, num_blocks=8)
    ex.pool[:, :, 3] = torch.randn(ex.pool[:, :, 3].shape)
    ex.copy_blocks([(3, 5)])
    assert torch.equal(ex.pool[:, :, 5], ex.pool[:, :, 3])


def test_corrupted_engine_is_refused_at_load(engine, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(engine, copy)
    data = copy / "rank0" / "main.onnx.data"  # the weights the ORT-optimized graph runs with (one copy)
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(EngineDirError, match="main.onnx.data .*corrupted"):
        OrtExecutor(copy)


def test_optimized_graphs_share_the_original_weights(engine):
    """ORT writes nearly all of its optimized copy's weights unchanged; the build points the copy at the original
    graph's weights file and keeps only what ORT changed (the tiny model: a few hundred bytes of `main`), so an
    onnxruntime engine's weights cost their size once on disk, not twice."""
    import onnx

    for graph in ("main", "mtp_draft", "mtp_commit"):
        optimized = engine / "rank0" / f"{graph}.ort.onnx"
        own = optimized.with_name(optimized.name + ".data")
        original = engine / "rank0" / f"{graph}.onnx.data"
        assert not own.exists() or own.stat().st_size < original.stat().st_size / 20, graph
        model = onnx.load(str(optimized), load_external_data=False)
        external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
        shared = [t for t in external for e in t.external_data if e.key == "location" and e.value == original.name]
        assert external and len(shared) >= len(external) - 2, (graph, len(shared), len(external))


def test_rank_outside_world_is_refused(engine):
    with pytest.raises(EngineDirError, match="rank 1 is outside"):
        OrtExecutor(engine, rank=1)


def test_every_step_of_a_built_engine_fits_its_recorded_limits(engine):
    """The engine's own config.json (limits, layout, K) bounds what the runtime sends: requests run to
    max_seq_len with K drafts through the ORT executor, each call checked against the profiles and width."""
    from builder.trt_build import profile_dims
    from models.engine_format import load_engine_config
    from models.engine_format.graph_io import GRAPH_NAMES
    from runtime.core.engine import LLMEngine
    from runtime.core.sampling import SamplingParams
    from runtime.factory import engine_defaults
    from tests.runtime.engine_utils import random_prompts
    from tests.runtime.test_engine_limits import ProfileCheckingExecutor

    ecfg = load_engine_config(engine)
    profiles = {g: profile_dims(g, ecfg.limits, ecfg.kv, ecfg.num_draft_tokens) for g in GRAPH_NAMES}
    rc = engine_defaults(ecfg)
    ex = ProfileCheckingExecutor(OrtExecutor(engine), profiles, ecfg.kv.table_width)
    lengths = [60, 61, 62, 63, 30]  # 5 requests > max_batch 4: one waits, then reuses freed blocks
    outs = LLMEngine(ex, ecfg.model, rc).generate(random_prompts(lengths), SamplingParams(max_tokens=64))
    assert [n + len(o.output_ids) for n, o in zip(lengths, outs, strict=True)] == [64] * 5
    assert max(dict(s)["max_blocks"] for s in ex.seen["main"]) == ecfg.kv.table_width == 17


def test_intra_op_threads_is_a_runtime_choice(engine):
    """The thread count is the caller's (machine, neighbours), not the engine's: it reaches every session
    without touching the sealed config.json (the bench once edited config.json for this)."""
    from models.engine_format import load_engine_config

    recorded = load_engine_config(engine).build["ort_session_options"]["intra_op_num_threads"]
    for threads in (1, 2):
        ex = OrtExecutor(engine, num_blocks=8, intra_op_threads=threads)
        assert {s.get_session_options().intra_op_num_threads for s in ex.sessions.values()} == {threads}
    default = OrtExecutor(engine, num_blocks=8)
    assert {s.get_session_options().intra_op_num_threads for s in default.sessions.values()} == {recorded}
    load_engine_config(engine)  # still sealed and valid
