"""Run under `mpirun -np W`: the tensor-parallel model (plugins/mapping.py + models/sharding.py)
equals the single-rank model. Args: world ep tp [fused|plain] [ep tp fused|plain ...]: several meshes of the
same world size run one after another in one launch (mpirun's start-up of W ranks is most of a mesh's cost).

Each DP group gets its own requests (a different number of rows per group, so the EP == W column exchange sees
uneven sends); every rank also runs the full model on its group's inputs as the reference. Steps: a prefill
forward_main, a draft depth (forward_draft), a commit (forward_commit) and a decode forward_main that reads the
KV written before. Prints TP_MODEL_RESULT failures=F worst=D on rank 0."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from mpi4py import MPI

from models.checkpoint import load_model
from models.glm4_moe import Glm4MoeMTPModel
from models.layers import PagedKV, StepMeta
from plugins.kv_pool import KVPoolGeometry, allocate_pool, pool_address
from plugins.mapping import Parallel, rank_mapping
from tests.mpi_launch import abort_on_error

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
BLOCK, BLOCKS_PER_REQ = 16, 4
TOL = 1e-5


def _kv(model: Glm4MoeMTPModel, num_requests: int) -> tuple[PagedKV, torch.Tensor]:
    local_kv_heads = model.layers[0].self_attn.num_kv_heads  # the pool holds this rank's KV heads only
    geom = KVPoolGeometry(model.num_kv_planes, 1 + num_requests * BLOCKS_PER_REQ, BLOCK, local_kv_heads,
                          model.cfg.head_dim)  # fmt: skip
    pool = allocate_pool(geom)
    return PagedKV(pool_address(pool), geom), pool


def _steps(model: Glm4MoeMTPModel, lens: list[int], seed: int) -> list[torch.Tensor]:
    """Outputs of prefill, draft, commit, decode for requests of `lens` prompt tokens."""
    kv, pool = _kv(model, len(lens))
    gen = torch.Generator().manual_seed(seed)
    vocab = model.cfg.vocab_size
    r = len(lens)
    tables = torch.arange(1, 1 + r * BLOCKS_PER_REQ, dtype=torch.int32).view(r, BLOCKS_PER_REQ)
    ids = torch.randint(0, vocab, (sum(lens),), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lens]) if lens else torch.zeros(0, dtype=torch.long)
    counts = torch.tensor(lens, dtype=torch.int32)
    outs = []
    with torch.no_grad():
        hidden = model.forward_main(ids, StepMeta(positions, counts, counts.clone(), tables), kv)
        outs += [hidden, model.compute_logits(hidden)]
        last = (torch.cumsum(counts, 0) - 1).long()
        nxt = torch.randint(0, vocab, (r,), generator=gen)
        ones = torch.ones(r, dtype=torch.int32)
        d_hidden, d_logits = model.forward_draft(hidden[last], nxt, counts.long() - 1 + 1, ones, tables, kv)
        outs += [d_hidden, d_logits]
        written = model.forward_commit(hidden, torch.roll(ids, -1), counts, torch.zeros(r, dtype=torch.int32),
                                       tables, kv)  # fmt: skip
        outs.append(written.float())
        dec = model.forward_main(nxt, StepMeta(counts.long(), ones, counts + 1, tables), kv)
        outs += [dec, model.compute_logits(dec)]
    del pool
    return outs


def _check_mesh(comm, world: int, ep: int, tp: int, fused: bool) -> int:
    rank = comm.Get_rank()
    ref, _ = load_model(TINY)
    mapping = rank_mapping(rank, Parallel(world, ep, tp), ref.cfg.n_routed_experts)
    model, _ = load_model(TINY, mapping=mapping)
    for m in (ref, model):
        if fused:
            m.fuse()
    lens = [[9, 21, 4], [6], [13, 2], [1]][mapping.dp_rank]  # a different batch in every DP group
    seed = 100 + mapping.dp_rank
    got = _steps(model, lens, seed)
    want = _steps(ref, lens, seed)
    failures, worst = 0, 0.0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        diff = float((g - w).abs().max()) if g.numel() else 0.0
        worst = max(worst, diff)
        if g.shape != w.shape or not torch.allclose(g, w, atol=TOL, rtol=TOL):
            failures += 1
            print(
                f"rank {rank} output {i}: shape {tuple(g.shape)} vs {tuple(w.shape)}, max diff {diff:.3g}", flush=True
            )
    total = comm.allreduce(failures)
    worst = comm.allreduce(worst, op=MPI.MAX)
    if rank == 0:
        mode = "fused" if fused else "plain"
        print(f"TP_MODEL_RESULT failures={total} worst={worst:.3g} world={world} ep={ep} tp={tp} mode={mode}",
              flush=True)  # fmt: skip
    return total


def main() -> int:
    world, rest = int(sys.argv[1]), sys.argv[2:]
    comm = MPI.COMM_WORLD
    assert comm.Get_size() == world, f"launched {comm.Get_size()} ranks, expected {world}"
    if len(rest) == 2:
        rest.append("fused")
    meshes = [(int(rest[i]), int(rest[i + 1]), rest[i + 2] == "fused") for i in range(0, len(rest), 3)]
    failed = [_check_mesh(comm, world, ep, tp, fused) for ep, tp, fused in meshes]
    return 1 if any(failed) else 0


if __name__ == "__main__":  # python -m tests.models.mpi_tp_worker W EP TP [MODE ...], under mpirun
    abort_on_error(main)
