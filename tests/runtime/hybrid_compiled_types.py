"""The compiled engine of each hybrid model type against the torch executor, by hand (not collected by pytest: each
build compiles packages, ~1-2 minutes, so the suite compiles one type, qwen3_next, in tests/builder/test_hybrid_engine.py;
the packages' code path is the same for all of them).

    PYTHONPATH=. python tests/runtime/hybrid_compiled_types.py [qwen3_5_text qwen3_5_moe ...]

Per model type: a random 2-layer checkpoint (one GDN, one gated attention layer; vocab 6, so drafts are both accepted
and rejected), `mtp-build` with its defaults (compiled packages), `mtp-build --check`, then greedy output ids of the
compiled engine at K=0, 2 and 3 with prefill chunks of 6 == the torch executor's at K=0. Exits non-zero on any
difference.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from builder import cli
from models.testing import make_hybrid_checkpoint
from runtime.core.sampling import SamplingParams
from runtime.executors.compiled_executor import CompiledExecutor
from runtime.factory import create_engine
from tests.runtime.engine_utils import random_prompts

LIMITS = dict(max_batch=4, max_num_tokens=32, max_seq_len=64)
PROMPTS = random_prompts((5, 13, 9, 22, 3), vocab=6, seed=0)
PARAMS = SamplingParams(max_tokens=12)


def check(model_type: str) -> None:
    root = Path(tempfile.mkdtemp())
    make_hybrid_checkpoint(root / "ckpt", model_type, seed=2, vocab_size=6, num_hidden_layers=2,
                           layer_types=["linear_attention", "full_attention"])  # fmt: skip
    argv = ["--checkpoint", str(root / "ckpt"), "--output", str(root / "engine"), "--kv-block-size", "4",
            "--num-draft-tokens", "3"] + [a for k, v in LIMITS.items() for a in (f"--{k.replace('_', '-')}", str(v))]  # fmt: skip
    assert cli.main(argv) == 0 and cli.main(["--check", str(root / "engine")]) == 0
    ref = create_engine(checkpoint=root / "ckpt", executor="torch", num_draft_tokens=0, block_size=4, num_blocks=200,
                        **LIMITS).generate(PROMPTS, PARAMS)  # fmt: skip
    for k in (0, 2, 3):
        engine = create_engine(engine_dir=root / "engine", num_draft_tokens=k, max_prefill_chunk=6)
        assert isinstance(engine.executor, CompiledExecutor), type(engine.executor).__name__
        got = engine.generate(PROMPTS, PARAMS)
        assert [o.output_ids for o in got] == [o.output_ids for o in ref], f"{model_type} K={k}"
        print(f"{model_type}: compiled K={k} == torch executor K=0")


if __name__ == "__main__":
    for model_type in sys.argv[1:] or ["qwen3_5_text", "qwen3_5_moe"]:
        check(model_type)
