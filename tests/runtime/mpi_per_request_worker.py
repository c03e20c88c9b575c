"""Run under `mpirun -np N python mpi_per_request_worker.py CKPT OUT [default]`: expert-parallel lockstep with
--num-draft-tokens per-request. Each rank serves prompts[rank::N] with its own forced k_i (a different pattern per
rank, so the ranks' deepest k_i differ), or with `default` the default policy (no flag: per-request, its cost model
profiled and agreed at creation), and records, per step, its own deepest k_i and the draft forwards it issued, and
its cost model; rank 0 writes every request's output ids and every rank's records to OUT as JSON."""

import json
import sys

from runtime.core.sampling import SamplingParams
from runtime.core.verify_lengths import FixedPattern
from runtime.factory import create_engine
from runtime.multirank.parallel import abort_on_error, mpi_world
from tests.runtime.engine_utils import random_prompts


class CountedDrafts:
    """The executor, counting its draft forwards (each rank must issue as many as every other, every step)."""

    def __init__(self, inner):
        self.inner, self.drafts = inner, 0

    def run_draft(self, inp):
        self.drafts += 1
        return self.inner.run_draft(inp)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def main() -> None:
    ckpt, out_path = sys.argv[1], sys.argv[2]
    comm, rank, world = mpi_world()
    counted: list[CountedDrafts] = []
    default = sys.argv[3:] == ["default"]
    policy = None if default else FixedPattern(((3, 1), (0, 2, 1))[rank % 2])

    engine = create_engine(checkpoint=ckpt, executor="torch", rank=rank, world_size=world,
                           num_draft_tokens=None if default else "per-request", block_size=4, num_blocks=100,
                           max_batch=4, max_num_tokens=64, max_seq_len=128, verify_lengths=policy,
                           wrap_executor=lambda ex: counted.append(CountedDrafts(ex)) or counted[0])  # fmt: skip
    prompts = random_prompts((5, 11, 8), seed=7)
    for i in range(rank, len(prompts), world):
        engine.add_request(prompts[i], SamplingParams(max_tokens=12 + 4 * i), req_id=str(i))
    outputs, deepest, drafts_per_step = {}, [], []
    while engine.ranks.any_busy(engine.has_unfinished()):
        before, choices = counted[0].drafts, len(policy.chosen) if policy else 0
        outputs.update({o.req_id: o.output_ids for o in engine.step() if o.finished})
        if policy is None:
            deepest.append(max(engine.last_step.k_per_request.values(), default=0))
        else:
            deepest.append(max(policy.chosen[-1], default=0) if len(policy.chosen) > choices else 0)
        drafts_per_step.append(counted[0].drafts - before)
    costs = engine.verify_lengths.cost.to_array().tolist() if default else []
    gathered = comm.gather((outputs, deepest, drafts_per_step, costs), root=0)
    if rank == 0:
        merged = {k: v for d, *_ in gathered for k, v in d.items()}
        with open(out_path, "w") as f:
            json.dump({"outputs": merged, "deepest": [g[1] for g in gathered], "drafts": [g[2] for g in gathered],
                       "costs": [g[3] for g in gathered]}, f)  # fmt: skip


if __name__ == "__main__":
    abort_on_error(main)
