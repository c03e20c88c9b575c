"""The share of step time spent in collectives at 1, 2 and 4 ranks, and mpi4py against torch.distributed gloo.

    python -m runtime.bench.collectives [--models tiny,deep] [--output bench_results/collectives.json]
    make bench-collectives

For each model (models/tiny, models/deep) and mapping (1 rank; TP2; DP2 x TP2 with EP4; EP4) the driver launches
`mpirun -np W --oversubscribe python -m runtime.bench.collectives --worker ...` (torch executor, weights sharded at
load, 1 thread per rank, greedy, K=2). Every leader times each engine.step() and the growth of
plugins.collectives.collective_seconds() (TP all-reduce / all-gather and the MoE all-to-all) over it, plus the
TP command broadcast (runtime/multirank/tp_group.py) and the DP lockstep check; followers report their whole-run share.
Medians over steps. Then, in the same processes (2 and 4 ranks), mpi4py `Allreduce` and torch.distributed gloo
`all_reduce` on the activation of a decode step and of a prefill chunk, interleaved call by call, medians.

The machine has 2 shared cores: 4 ranks oversubscribe them, so collective waits there include the time a
peer spends descheduled; the numbers say what this VM does, not what a 4-GPU node would.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAPPINGS = {"1 rank": (1, 1, 1), "TP2": (2, 2, 2), "DP2xTP2/EP4": (4, 2, 4), "EP4": (4, 1, 4)}  # (W, TP, EP)
K, BATCH, MAX_TOKENS, PROMPT_LEN = 2, 4, 48, 48
PREFILL_ROWS = 256  # one prefill chunk's activation rows (max_prefill_chunk below)
REPS = 200


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ---------------------------------------------------------------------- the worker (one rank under mpirun)
def worker(model: str, tp: int, ep: int, gloo_port: int) -> None:
    import torch

    torch.set_num_threads(1)
    from plugins.collectives import collective_seconds
    from runtime.core.sampling import SamplingParams
    from runtime.factory import create_engine
    from runtime.multirank.parallel import mpi_world

    comm, rank, world = mpi_world()
    engine = create_engine(checkpoint=ROOT / "models" / model, executor="torch", rank=rank, world_size=world,
                           tp_size=tp, ep_size=ep, num_draft_tokens=K, max_batch=BATCH, max_num_tokens=PREFILL_ROWS,
                           max_prefill_chunk=PREFILL_ROWS, max_seq_len=PROMPT_LEN + MAX_TOKENS + 8, num_blocks=64,
                           block_size=16, prog="bench-collectives")  # fmt: skip
    ranks = engine.ranks
    role = getattr(ranks, "role", None)  # the RankRole of a multi-rank strategy (its bcast time is reported)
    steps: list[tuple[float, float, float]] = []  # per leader step: (wall, collective seconds, command bcast)
    t_run = time.perf_counter()
    c_run = collective_seconds()
    if role is not None and ranks.is_follower:
        role.follow()
    else:
        gen = torch.Generator().manual_seed(5)
        for i in range(BATCH * ranks.dp_size):
            if i % ranks.dp_size == ranks.dp_rank:
                ids = torch.randint(0, engine.model_cfg.vocab_size, (PROMPT_LEN,), generator=gen).tolist()
                engine.add_request(ids, SamplingParams(max_tokens=MAX_TOKENS), req_id=f"r{i}")
        while ranks.any_busy(engine.has_unfinished()):  # engine.stream(), one step at a time, timed
            c0, b0, t0 = collective_seconds(), role.bcast_seconds if role else 0.0, time.perf_counter()
            engine.step()
            steps.append((time.perf_counter() - t0, collective_seconds() - c0,
                          (role.bcast_seconds if role else 0.0) - b0))  # fmt: skip
        ranks.stop()
    run_wall, run_coll = time.perf_counter() - t_run, collective_seconds() - c_run
    latency = _latency(comm, rank, world, gloo_port, engine.model_cfg.hidden_size) if world > 1 else None
    mine = {"rank": rank, "leader": not ranks.is_follower, "steps": steps, "run_wall": run_wall,
            "run_collective": run_coll}  # fmt: skip
    gathered = comm.gather(mine, root=0) if comm is not None else [mine]
    if rank == 0:
        print("BENCH_RESULT " + json.dumps({"ranks": gathered, "latency": latency}), flush=True)


def _latency(comm, rank: int, world: int, port: int, hidden: int) -> dict:
    """mpi4py Allreduce vs gloo all_reduce over all ranks, interleaved, on decode- and prefill-sized rows."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out = {}
    for label, rows in (("decode step", BATCH * (1 + K)), ("prefill chunk", PREFILL_ROWS)):
        x = np.random.default_rng(rank).standard_normal((rows, hidden), dtype=np.float32)
        recv, t = np.empty_like(x), torch.from_numpy(x.copy())
        mpi_s, gloo_s = [], []
        for i in range(REPS + 10):
            comm.Barrier()
            t0 = time.perf_counter()
            comm.Allreduce(x, recv, op=MPI.SUM)
            t1 = time.perf_counter()
            comm.Barrier()
            t2 = time.perf_counter()
            dist.all_reduce(t)
            t3 = time.perf_counter()
            if i >= 10:  # warm-up
                mpi_s.append(t1 - t0)
                gloo_s.append(t3 - t2)
        out[label] = {"rows": rows, "bytes": x.nbytes, "mpi4py_us": 1e6 * _median(mpi_s),
                      "gloo_us": 1e6 * _median(gloo_s)}  # fmt: skip
    dist.destroy_process_group()
    return out


# ---------------------------------------------------------------------- the driver
def summarize(raw: dict) -> dict:
    leaders = [r for r in raw["ranks"] if r["leader"]]
    steps = [s for r in leaders for s in r["steps"]]
    shares = [c / w for w, c, _ in steps if w > 0]
    bcast = [b / w for w, _, b in steps if w > 0]
    return {
        "steps": len(steps),
        "step_ms_median": 1e3 * _median([w for w, _, _ in steps]),
        "collective_share_median": _median(shares),
        "command_bcast_share_median": _median(bcast),
        "collective_share_per_rank": [round(r["run_collective"] / r["run_wall"], 4) for r in raw["ranks"]],
        "latency": raw["latency"],
    }


def run_mapping(model: str, world: int, tp: int, ep: int, port: int, timeout: int) -> dict:
    mpirun = Path(sys.executable).parent / "mpirun"
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
    cmd = [str(mpirun), "-np", str(world), "--oversubscribe", sys.executable, "-m", "runtime.bench.collectives",
           "--worker", model, str(tp), str(ep), str(port)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("BENCH_RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return summarize(json.loads(lines[0].removeprefix("BENCH_RESULT ")))


def combine(rounds: list[dict]) -> dict:
    """One configuration over its rounds: medians, with the spread of the share (the VM's noise is large)."""
    shares = [r["collective_share_median"] for r in rounds]
    out = {"rounds": len(rounds), "steps_per_round": rounds[0]["steps"],
           "step_ms_median": _median([r["step_ms_median"] for r in rounds]),
           "collective_share_median": _median(shares), "collective_share_min": min(shares),
           "collective_share_max": max(shares),
           "command_bcast_share_median": _median([r["command_bcast_share_median"] for r in rounds]),
           "per_round": rounds}  # fmt: skip
    if rounds[0]["latency"]:
        out["latency_us_median"] = {
            size: {lib: _median([r["latency"][size][f"{lib}_us"] for r in rounds]) for lib in ("mpi4py", "gloo")}
            | {"bytes": rounds[0]["latency"][size]["bytes"]}
            for size in rounds[0]["latency"]
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench-collectives", description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,deep", help="directories under models/ (default tiny,deep)")
    p.add_argument("--rounds", type=int, default=3, help="rounds over every configuration, interleaved (default 3)")
    p.add_argument("--output", type=Path, default=ROOT / "bench_results" / "collectives.json")
    p.add_argument("--timeout", type=int, default=900, help="seconds per mpirun launch")
    p.add_argument("--worker", nargs=4, metavar=("MODEL", "TP", "EP", "GLOO_PORT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        model, tp, ep, port = args.worker
        worker(model, int(tp), int(ep), int(port))
        return 0
    from runtime.serving.process import free_ports

    raw: dict[tuple[str, str], list[dict]] = {}
    for rnd in range(args.rounds):
        for model in args.models.split(","):
            for name, (world, tp, ep) in MAPPINGS.items():
                res = run_mapping(model, world, tp, ep, free_ports(1)[0], args.timeout)
                raw.setdefault((model, name), []).append(res)
                print(f"round {rnd + 1} {model:5s} {name:12s} step {res['step_ms_median']:7.1f} ms  collectives "
                      f"{100 * res['collective_share_median']:5.1f}%  command bcast "
                      f"{100 * res['command_bcast_share_median']:4.1f}%", flush=True)  # fmt: skip
    results: dict = {}
    for (model, name), rounds in raw.items():
        results.setdefault(model, {})[name] = combine(rounds)
    doc = {"command": "python -m runtime.bench.collectives " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "threads_per_rank": 1},
           "workload": {"K": K, "requests_per_dp_group": BATCH, "prompt_tokens": PROMPT_LEN, "max_tokens": MAX_TOKENS,
                        "prefill_rows": PREFILL_ROWS, "latency_reps": REPS},
           "results": results}  # fmt: skip
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(doc, indent=1) + "\n")
    for model, by_name in results.items():
        for name, r in by_name.items():
            print(f"{model:5s} {name:12s} step {r['step_ms_median']:7.1f} ms  collectives "
                  f"{100 * r['collective_share_median']:5.1f}% ({100 * r['collective_share_min']:.0f}-"
                  f"{100 * r['collective_share_max']:.0f}%)")  # fmt: skip
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
