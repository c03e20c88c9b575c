"""Run under `mpirun -np N python mpi_tp_worker.py SOURCE OUT MODE TP EP KS`: tensor-parallel serving.

SOURCE may name several directories, comma-separated: they run one after another in one launch (starting the ranks
is most of a small model's cost on a 2-core machine) and OUT holds a JSON list, one results object per source.

SOURCE: a checkpoint directory (torch executor, weights replicated over the TP group, EP 1 or N) or an
engine directory built with --tp-size (executor $MTP_TEST_EXECUTOR, default auto: its compiled packages when it
has them, else onnxruntime; its config gives TP and EP, the TP/EP arguments must match).
Each DP leader serves its share of PROMPTS (chunked prefill, a shared prefix for prefix hits, requests
arriving mid-run so batches mix prefill and decode); followers replay. For each K in KS (comma-separated) a
fresh engine runs ("auto": the leaders agree on each step's k over the leaders comm); rank 0 writes {"K": {"outputs": ..., "calls": [per-rank executor calls], "heads": [per-rank q heads],
"collective_seconds": [...], "accepted": [per-rank (accepted, proposed) drafts per position],
"experts": [per-rank routed experts held (first MoE layer)], "experts_per_layer": [per-rank list, every MoE layer the
model holds, MTP layers included], "executors": [per-rank executor class], "prefix_hit_tokens": leaders' sum,
"gdn_heads": [per-rank Gated DeltaNet value heads (null: no GDN layer)]}}
to OUT.
MODE "ok": as above. MODE "kill": every rank writes its pid to OUT.pid<rank>, the leaders serve forever.
MODE "idle": the leader idles (no step in progress) for 2.5 x the collective timeout after its second step:
the followers' wait for the next step is not armed, so the run must still succeed.
"""

import json
import os
import sys
import time
from pathlib import Path

from plugins.collectives import collective_seconds
from runtime.core.sampling import SamplingParams
from runtime.factory import create_engine
from runtime.multirank.parallel import RanksDisagree, abort_on_error, mpi_world
from runtime.multirank.tp_group import run_follower
from tests.runtime.engine_utils import random_prompts

PROG = "mpi_tp_worker"
SETTINGS = dict(block_size=4, num_blocks=100, max_batch=4, max_num_tokens=64, max_seq_len=128, max_prefill_chunk=8)


def prompts(vocab: int = 96) -> tuple[list[list[int]], list[list[int]]]:
    """(first wave, late arrivals) of ids below `vocab`; the late ones share a 16-token prefix with the first prompt."""
    base = random_prompts((20, 5, 11), vocab=vocab, seed=7)
    late = [base[0][:16] + random_prompts((3,), vocab=vocab, seed=8)[0], list(base[0]),
            random_prompts((9,), vocab=vocab, seed=9)[0]]  # fmt: skip
    return base, late


def run_one(source: Path, k: int | str, tp: int, ep: int, timeout: float, mode: str, comm) -> dict | None:
    if (source / "manifest.json").is_file():  # an engine: its limits and KV layout are its own
        kwargs: dict = dict(engine_dir=source, max_prefill_chunk=SETTINGS["max_prefill_chunk"],
                            executor=os.environ.get("MTP_TEST_EXECUTOR", "auto"))  # fmt: skip
    else:
        kwargs = dict(checkpoint=source, executor="torch", tp_size=tp, ep_size=ep, **SETTINGS)
    _, rank, world = mpi_world()
    engine = create_engine(**kwargs, rank=rank, world_size=world, num_draft_tokens=k, collective_timeout=timeout,
                           prog=PROG)  # fmt: skip
    if kwargs.get("engine_dir"):
        par = getattr(engine.ranks, "role", None) and engine.ranks.role.executor.config.parallel
        assert par is not None and (par.tp_size, par.ep_size) == (tp, ep), f"engine mapping {par} != tp={tp} ep={ep}"
    role = engine.ranks.role  # a multi-rank strategy's RankRole
    assert role is not None
    if mode == "kill":
        Path(f"{os.environ['OUT']}.pid{rank}").write_text(str(os.getpid()))
    if not role.is_leader:
        run_follower(role, PROG)
        outputs: dict = {}
    else:
        m = role.mapping
        first, late = prompts(min(96, engine.model_cfg.vocab_size))  # a tiny-vocab model: drafts get accepted
        params = SamplingParams(max_tokens=12)
        mine = [i for i in range(len(first)) if i % m.dp == m.dp_rank]
        late_mine = [i for i in range(len(late)) if i % m.dp == m.dp_rank]
        for i in mine:
            engine.add_request(first[i], params, req_id=f"a{i}")
        if not mine:
            for i in late_mine:
                engine.add_request(late[i], params, req_id=f"b{i}")
        outputs, added, n = {}, not mine, 0

        def stream():
            """engine.stream(); in mode "idle" the leader sits idle past the watchdog's timeout before step 2."""
            while engine.ranks.any_busy(engine.has_unfinished()):
                if mode == "idle" and role.dog.step == 2:
                    time.sleep(2.5 * timeout)
                yield from engine.step()

        for out in stream():
            if out.finished:
                outputs[out.req_id] = out.output_ids
                if not added:  # late arrivals join a batch still decoding the first wave
                    added = True
                    for i in late_mine:
                        engine.add_request(late[i], params, req_id=f"b{i}")
                if mode == "kill":  # serve forever: every finished request is replaced
                    n += 1
                    engine.add_request(first[n % len(first)], params, req_id=f"k{n}")
        role.stop()
    model = getattr(role.executor, "model", None)  # torch executor: this rank's q heads (a hybrid's first attention)
    attn = next((layer.self_attn for layer in model.layers if hasattr(layer, "self_attn")), None) if model else None
    gdn = next((layer.linear_attn for layer in model.layers if hasattr(layer, "linear_attn")), None) if model else None
    named = model.named_parameters() if model else ()
    held = [p.shape[0] for n, p in named if n.endswith("w_gate_up")]  # routed experts held here, per MoE layer
    experts = held[0] if held else None
    met = engine.metrics
    accepted = (met.accepted_per_position, met.proposed_per_position) if role.is_leader else ([], [])
    hits = met.prefix_hit_tokens if role.is_leader else 0
    gathered = comm.gather((outputs, role.num_calls, attn and attn.num_heads, collective_seconds(), accepted, experts,
                            type(role.executor).__name__, hits, gdn and gdn.hv, held),
                           root=0)  # fmt: skip
    if rank != 0:
        return None
    return {"outputs": {key: v for g in gathered for key, v in g[0].items()}, "calls": [g[1] for g in gathered],
            "heads": [g[2] for g in gathered], "collective_seconds": [g[3] for g in gathered],
            "accepted": [g[4] for g in gathered], "experts": [g[5] for g in gathered],
            "executors": [g[6] for g in gathered], "prefix_hit_tokens": sum(g[7] for g in gathered),
            "gdn_heads": [g[8] for g in gathered], "experts_per_layer": [g[9] for g in gathered]}


def main() -> None:
    sources, out_path, mode = [Path(s) for s in sys.argv[1].split(",")], sys.argv[2], sys.argv[3]
    tp, ep, ks = int(sys.argv[4]), int(sys.argv[5]), [k if k in ("auto", "per-request") else int(k) for k in sys.argv[6].split(",")]
    timeout = float(os.environ.get("MTP_TEST_COLLECTIVE_TIMEOUT", "60"))
    os.environ["OUT"] = out_path
    comm, rank, _ = mpi_world()
    results = [{str(k): run_one(source, k, tp, ep, timeout, mode, comm) for k in ks} for source in sources]
    if rank == 0:
        Path(out_path).write_text(json.dumps(results[0] if len(sources) == 1 else results))


if __name__ == "__main__":
    try:
        abort_on_error(main, prog=PROG)
    except RanksDisagree as e:  # raised on every rank: all exit 2, rank 0 says why
        if mpi_world()[1] == 0:
            print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(2)
