"""--num-draft-tokens auto under a real mpirun: every rank picks the same draft length every step (so the
collective-bearing draft forwards stay in lockstep, an idle rank included) and outputs equal K=0."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

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


@pytest.mark.parametrize("policy", ["forced", "default"])
def test_ep2_ranks_agree_on_the_draft_loop(checkpoint, tmp_path, policy):  # noqa: F811
    """Per-request draft lengths (tests/runtime/test_per_request_k.py; here, with this file's mpirun tests, so that
    file's single-process tests stay off the mpirun group's worker). EP2 lockstep, each rank its own requests and
    forced k_i: outputs equal K=0, and every rank issues the same number of draft forwards every step (the deepest
    k_i over both ranks; a rank with shorter k_i pads). `default`: the default policy, whose cost model each rank
    times at creation: the ranks hold the same agreed figures (the elementwise maximum)."""
    ref_engine = create_engine(checkpoint=checkpoint, executor="torch", num_draft_tokens=0, block_size=4,
                               num_blocks=100, max_batch=4, max_num_tokens=64, max_seq_len=128)  # fmt: skip
    prompts = random_prompts((5, 11, 8), seed=7)
    ref = {str(i): ref_engine.generate([p], SamplingParams(max_tokens=12 + 4 * i))[0].output_ids
           for i, p in enumerate(prompts)}  # fmt: skip
    out = tmp_path / "out.json"
    proc = mpirun(2, checkpoint, out, *(["default"] if policy == "default" else []), worker="mpi_per_request_worker.py")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["outputs"] == ref
    drafts, deepest = result["drafts"], result["deepest"]
    assert drafts[0] == drafts[1]
    assert [max(a, b) for a, b in zip(*deepest, strict=True)] == drafts[0]  # the deepest k_i of either rank
    if policy == "default":  # (on this small torch model a draft call costs about a verify: it may never draft)
        costs = result["costs"]
        assert costs[0] == costs[1] and min(costs[0]) > 0
    else:
        assert sum(drafts[0]) > 0
        assert any(a != b for a, b in zip(*deepest, strict=True)), deepest  # they differed: a rank padded
