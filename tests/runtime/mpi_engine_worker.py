"""Run under `mpirun -np N python mpi_engine_worker.py CKPT OUT MODE`: expert-parallel lockstep serving.

Each rank loads 1/N of the routed experts and serves prompts[rank::N] (rank N-1 may have none: it must
keep stepping with dummy forwards). Rank 0 writes every request's output ids to OUT as JSON.
MODE "fail": rank 1 raises in its third step; every rank must exit (MPI Abort) instead of hanging.
"""

import json
import sys

from runtime.factory import create_engine
from runtime.parallel import abort_on_error, lockstep_stream, mpi_world
from runtime.sampling import SamplingParams
from tests.runtime.engine_utils import random_prompts


def main() -> None:
    ckpt, out_path, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    comm, rank, world = mpi_world()
    engine = create_engine(checkpoint=ckpt, executor="torch", rank=rank, world_size=world, num_draft_tokens=2,
                           block_size=4, num_blocks=100, max_batch=4, max_num_tokens=64, max_seq_len=128)  # fmt: skip
    prompts = random_prompts((5, 11, 8), seed=7)
    for i in range(rank, len(prompts), world):
        engine.add_request(prompts[i], SamplingParams(max_tokens=10), req_id=str(i))
    if mode == "fail" and rank == 1:
        real_step, calls = engine.step, [0]

        def failing_step():
            calls[0] += 1
            if calls[0] == 3:
                raise RuntimeError("injected failure on rank 1")
            return real_step()

        engine.step = failing_step
    outputs = {o.req_id: o.output_ids for o in lockstep_stream(engine, comm) if o.finished}
    gathered = comm.gather(outputs, root=0)
    if rank == 0:
        merged = {k: v for d in gathered for k, v in d.items()}
        with open(out_path, "w") as f:
            json.dump({"outputs": merged, "steps": engine.metrics.num_steps}, f)


if __name__ == "__main__":
    abort_on_error(main)
