"""Run under `mpirun -np N python mpi_engine_worker.py CKPT OUT MODE [K]`: expert-parallel lockstep serving.

Each rank loads 1/N of the routed experts and serves prompts[rank::N] (rank N-1 may have none: it must
keep stepping with dummy forwards). Rank 0 writes every request's output ids to OUT as JSON.
MODE "fail": rank 1 raises in its third step; every rank must exit instead of hanging.
MODE "kill": every rank writes its pid to OUT.pid<rank> and serves forever (a finished request is
replaced by a new one), so the test can kill -9 one rank mid-collective.
K (default 2): draft depth of this rank; MPMD launches give ranks different K to test the settings check.
"""

import json
import os
import sys

from runtime.core.sampling import SamplingParams
from runtime.factory import create_engine
from runtime.multirank.parallel import RanksDisagree, abort_on_error, mpi_world
from tests.runtime.engine_utils import random_prompts


def main() -> None:
    ckpt, out_path, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    k = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    comm, rank, world = mpi_world()
    engine = create_engine(checkpoint=ckpt, executor="torch", rank=rank, world_size=world, num_draft_tokens=k,
                           block_size=4, num_blocks=100, max_batch=4, max_num_tokens=64, max_seq_len=128)  # fmt: skip
    prompts = random_prompts((5, 11, 8), seed=7)
    for i in range(rank, len(prompts), world):
        engine.add_request(prompts[i], SamplingParams(max_tokens=10), req_id=str(i))
    fail_at = 3 if mode == "fail" and rank == 1 else None

    def stream():
        """engine.stream(), with rank 1 failing before its third step in mode "fail"."""
        steps = 0
        while engine.ranks.any_busy(engine.has_unfinished()):
            steps += 1
            if steps == fail_at:
                raise RuntimeError("injected failure on rank 1")
            yield from engine.step()

    if mode == "kill":
        with open(f"{out_path}.pid{rank}", "w") as f:
            f.write(str(os.getpid()))
        engine.add_request(prompts[0], SamplingParams(max_tokens=10), req_id=f"r{rank}-0")
        for n, _ in enumerate(o for o in stream() if o.finished):
            engine.add_request(prompts[n % 3], SamplingParams(max_tokens=10), req_id=f"r{rank}-{n + 1}")
    outputs = {o.req_id: o.output_ids for o in stream() if o.finished}
    gathered = comm.gather(outputs, root=0)
    if rank == 0:
        merged = {k: v for d in gathered for k, v in d.items()}
        with open(out_path, "w") as f:
            json.dump({"outputs": merged, "steps": engine.metrics.num_steps}, f)


if __name__ == "__main__":
    try:
        abort_on_error(main, prog="mpi_engine_worker")
    except RanksDisagree as e:  # raised on every rank: all exit 2, rank 0 says why
        if mpi_world()[1] == 0:
            print(f"mpi_engine_worker: error: {e}", file=sys.stderr)
        sys.exit(2)
