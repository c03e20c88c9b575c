"""Run under `mpirun -np W`: each rank runs its shard of a tensor-parallel ONNX Runtime engine (built by
`mtp-build --tp-size ...`) through runtime.executors.ort_executor and compares main / draft / commit outputs
with the single-rank torch model. Args: ENGINE_DIR CHECKPOINT. Prints TP_ENGINE_RESULT failures=F worst=D."""

from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

from models.checkpoint import load_model
from models.engine_format import load_engine_config
from plugins.mapping import rank_mapping
from runtime.executors.base import CommitInput, DraftInput, MainInput
from runtime.executors.ort_executor import OrtExecutor
from runtime.executors.torch_executor import TorchExecutor
from tests.mpi_launch import abort_on_error

TOL = 1e-5
BLOCKS = 40


def _steps(cfg, dp_rank: int):
    """Calls for this DP group: prefill, a mixed prefill/verify step with a padded request, draft, commit."""
    rng = np.random.default_rng(11 + dp_rank)
    mb, vocab = cfg.kv.table_width, cfg.model.vocab_size
    ids = rng.permutation(np.arange(1, BLOCKS))[:12].reshape(3, 4)
    tables = np.full((3, mb), -1, np.int32)
    tables[:, :4] = ids
    lens = [[5, 17, 3], [9, 2, 6]][dp_rank % 2]
    first = MainInput(input_ids=rng.integers(0, vocab, sum(lens)),
                      positions=np.concatenate([np.arange(n) for n in lens]), q_counts=np.array(lens, np.int32),
                      kv_lens=np.array(lens, np.int32), block_tables=tables,
                      logit_rows=np.cumsum(lens) - 1)  # fmt: skip
    tables2 = tables.copy()
    tables2[2] = -1
    second = MainInput(input_ids=rng.integers(0, vocab, 6),
                       positions=np.array([lens[0], lens[0] + 1, lens[0] + 2, lens[1], lens[1] + 1, lens[1] + 2]),
                       q_counts=np.array([3, 3, 0], np.int32), kv_lens=np.array([lens[0] + 3, lens[1] + 3, 0], np.int32),
                       block_tables=tables2, logit_rows=np.arange(6))  # fmt: skip
    return first, second, tables, lens, rng


def main() -> int:
    engine, checkpoint = sys.argv[1], sys.argv[2]
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    cfg = load_engine_config(engine)
    mapping = rank_mapping(rank, cfg.parallel, cfg.model.n_routed_experts)
    ort_ex = OrtExecutor(engine, rank=rank, num_blocks=BLOCKS, intra_op_threads=1)
    ref_ex = TorchExecutor(load_model(checkpoint)[0], num_blocks=BLOCKS, block_size=cfg.kv.block_size)
    first, second, tables, lens, rng = _steps(cfg, mapping.dp_rank)
    results: list[tuple[str, np.ndarray, np.ndarray]] = []
    for i, step in enumerate((first, second)):
        a, b = ort_ex.run_main(step), ref_ex.run_main(step)
        results += [(f"main{i}.hidden", a.hidden, b.hidden), (f"main{i}.logits", a.logits, b.logits)]
        if i == 0:
            hidden = b.hidden
    last = np.cumsum(lens) - 1
    draft = DraftInput(hidden_in=hidden[last], token_ids=rng.integers(0, cfg.model.vocab_size, 3),
                       positions=np.array(lens, np.int64) + 3, counts=np.array([1, 1, 0], np.int32),
                       block_tables=tables)  # fmt: skip
    a_d, b_d = ort_ex.run_draft(draft), ref_ex.run_draft(draft)
    results += [("draft.hidden", a_d.hidden_out, b_d.hidden_out), ("draft.logits", a_d.logits, b_d.logits)]
    commit = CommitInput(hidden_in=hidden, token_ids=np.roll(first.input_ids, -1), counts=np.array(lens, np.int32),
                         starts=np.zeros(3, np.int32), block_tables=tables)  # fmt: skip
    wa, wb = ort_ex.run_commit(commit), ref_ex.run_commit(commit)
    results.append(("commit.rows", np.array([wa], np.float32), np.array([wb], np.float32)))
    failures, worst = 0, 0.0
    for what, got, want in results:
        diff = float(np.abs(got - want).max()) if got.shape == want.shape and got.size else 0.0
        worst = max(worst, diff)
        if got.shape != want.shape or not np.allclose(got, want, atol=TOL, rtol=TOL):
            failures += 1
            print(f"rank {rank} {what}: shape {got.shape} vs {want.shape}, max diff {diff:.3g}", flush=True)
    total, worst = comm.allreduce(failures), comm.allreduce(worst, op=MPI.MAX)
    if rank == 0:
        print(f"TP_ENGINE_RESULT failures={total} worst={worst:.3g} parallel={cfg.parallel}", flush=True)
    return 1 if total else 0


if __name__ == "__main__":  # python -m tests.builder.mpi_tp_engine_worker ENGINE CKPT, under mpirun
    abort_on_error(main)
