"""--num-draft-tokens auto under a real mpirun: every rank picks the same draft length every step (so the
collective-bearing draft forwards stay in lockstep, an idle rank included) and outputs equal K=0."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from runtime.core.sampling import SamplingParams
from runtime.factory import create_engine
from tests.runtime.engine_utils import random_prompts
from tests.runtime.test_mpi_lockstep import MPIRUN, ROOT, checkpoint, pytestmark  # noqa: F401 - shared fixture/marker


def mpirun(np_: int, *args, timeout: int = 300, worker: str = "mpi_auto_worker.py") -> subprocess.CompletedProcess:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONPATH=str(ROOT),
               OMP_NUM_THREADS="1")  # fmt: skip
    cmd = [str(MPIRUN), "-np", str(np_), "--oversubscribe", sys.executable,
           str(ROOT / "tests/runtime" / worker), *map(str, args)]  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_auto_draft_length_is_decided_identically_on_all_ranks(checkpoint, tmp_path):  # noqa: F811
    ref_engine = create_engine(checkpoint=checkpoint, executor="torch", num_draft_tokens=0, block_size=4,
                               num_blocks=100, max_batch=4, max_num_tokens=64, max_seq_len=128)  # fmt: skip
    prompts = random_prompts((5, 11, 8), seed=7)
    ref = {str(i): o.output_ids for i, o in enumerate(ref_engine.generate(prompts, SamplingParams(max_tokens=16)))}
    for ranks in (2, 4):  # 4 ranks, 3 prompts: rank 3 is idle throughout and still follows every decision
        out = tmp_path / f"out{ranks}.json"
        proc = mpirun(ranks, checkpoint, out)
        assert proc.returncode == 0, proc.stderr[-2000:]
        result = json.loads(out.read_text())
        assert result["outputs"] == ref
        chosen = result["chosen"]
        assert all(c == chosen[0] for c in chosen), chosen
        assert len(set(chosen[0])) >= 2  # the warm-up tries several lengths, so agreement is not trivial
