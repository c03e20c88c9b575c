"""MTP behaviour on the shipped trained tiny model (models/tiny):

* Hugging Face parity: for K = 1 and batch 1, the accepted count of every verify step equals what
  transformers' `generate(..., use_mtp=True)` accepts on the same checkpoint, and the tokens match.
* Acceptance does not decay: with the commit pass, conditional acceptance at depths >= 2 is higher
  than with `--no-commit-pass` (the ablation keeps chained draft entries at accepted positions).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.factory import create_engine
from runtime.sampling import SamplingParams

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
SNIPPETS = [
    "def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n\n\ndef ",
    "class Queue:\n    def __init__(self, maxsize=0):\n        self.maxsize = maxsize\n        self.",
    "import os\nimport sys\n\n\ndef main(argv=None):\n    if argv is None:\n        argv = sys.argv[1:]\n    ",
    "    for i, line in enumerate(lines):\n        if not line.strip():\n            continue\n        ",
]


def engine(k: int, **kw):
    return create_engine(checkpoint=TINY, executor="torch", num_draft_tokens=k, block_size=16, num_blocks=256,
                         max_batch=4, max_num_tokens=128, max_seq_len=512, **kw)  # fmt: skip


@pytest.mark.parametrize("snippet", SNIPPETS[:2])
def test_k1_acceptance_matches_hugging_face_generate_use_mtp(snippet):
    transformers = pytest.importorskip("transformers")
    from transformers.generation.candidate_generator import MTPCandidateGenerator

    hf = transformers.Glm4MoeForCausalLM.from_pretrained(str(TINY)).eval()
    num_layers = hf.config.num_hidden_layers
    hf._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{num_layers}\..*"]  # see docs/MTP_HIDDEN_STATES.md
    matches: list[int] = []
    original = MTPCandidateGenerator.update_candidate_strategy

    def record(self, input_ids, scores, num_matches):
        matches.append(int(num_matches))
        return original(self, input_ids, scores, num_matches)

    eng = engine(1)
    prompt = eng.tokenizer.encode(snippet).ids
    max_new = 40
    MTPCandidateGenerator.update_candidate_strategy = record
    try:
        hf_out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, use_mtp=True)
    finally:
        MTPCandidateGenerator.update_candidate_strategy = original
    ours = eng.generate([prompt], SamplingParams(max_tokens=max_new))[0]
    assert ours.output_ids == hf_out[0, len(prompt) :].tolist()
    hf_steps = matches[1:]  # the first call follows the prefill forward (no draft yet)
    n = min(len(hf_steps), len(ours.accepted_per_step)) - 1  # the last step may be cut by max_new_tokens
    assert n > 5 and sum(hf_steps[:n]) > 0
    assert ours.accepted_per_step[:n] == hf_steps[:n]


def acceptance(k: int, commit_pass: bool):
    eng = engine(k, commit_pass=commit_pass)
    prompts = [eng.tokenizer.encode(s).ids for s in SNIPPETS]
    eng.generate(prompts, SamplingParams(max_tokens=96))
    return eng.metrics


def test_commit_pass_prevents_acceptance_decay():
    with_commit = acceptance(3, True)
    without = acceptance(3, False)
    cond_with, cond_without = with_commit.conditional_acceptance_per_position, without.conditional_acceptance_per_position
    print("conditional acceptance with commit pass:", cond_with, "without:", cond_without)
    assert cond_with[0] > 0.3, "the trained MTP module should draft well at depth 1"
    # without the refresh, last step's accepted positions keep chained entries; deeper depths see more of them
    assert cond_with[1] > cond_without[1] and cond_with[2] > cond_without[2]
    assert with_commit.mean_acceptance_length > without.mean_acceptance_length
