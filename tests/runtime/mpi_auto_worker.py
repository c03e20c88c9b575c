"""Run under `mpirun -np N python mpi_auto_worker.py CKPT OUT`: expert-parallel lockstep with
--num-draft-tokens auto. Each rank serves prompts[rank::N] and records the draft length it chose each step;
rank 0 writes every request's output ids and every rank's choices to OUT as JSON."""

import json
import sys

from runtime.core.config import RuntimeConfig
from runtime.core.draft_length import DraftLengthController
from runtime.core.sampling import SamplingParams
from runtime.factory import create_engine
from runtime.multirank.parallel import abort_on_error, mpi_world
from tests.runtime.engine_utils import random_prompts


def main() -> None:
    ckpt, out_path = sys.argv[1], sys.argv[2]
    comm, rank, world = mpi_world()
    chosen: list[int] = []

    class Recorded(DraftLengthController):
        """auto's controller, recording every k it picks (each rank's list must be the same)."""

        def choose(self, num_drafting, base_rows, remaining=None):
            k = super().choose(num_drafting, base_rows, remaining)
            chosen.append(k)
            return k

    engine = create_engine(checkpoint=ckpt, executor="torch", rank=rank, world_size=world, num_draft_tokens="auto",
                           block_size=4, num_blocks=100, max_batch=4, max_num_tokens=64, max_seq_len=128,
                           draft_length=Recorded(RuntimeConfig().num_draft_tokens))  # fmt: skip
    prompts = random_prompts((5, 11, 8), seed=7)
    for i in range(rank, len(prompts), world):
        engine.add_request(prompts[i], SamplingParams(max_tokens=16), req_id=str(i))
    outputs = {o.req_id: o.output_ids for o in engine.stream() if o.finished}
    gathered = comm.gather((outputs, chosen), root=0)
    if rank == 0:
        merged = {k: v for d, _ in gathered for k, v in d.items()}
        with open(out_path, "w") as f:
            json.dump({"outputs": merged, "chosen": [c for _, c in gathered]}, f)


if __name__ == "__main__":
    abort_on_error(main)
