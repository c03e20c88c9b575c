"""MTP behaviour on the shipped trained tiny model (models/tiny):

* Hugging Face parity: for K = 1 and batch 1, the accepted count of every verify step equals what
  transformers' `generate(..., use_mtp=True)` accepts on the same checkpoint, and the tokens match.
* Acceptance does not decay: with the commit pass, conditional acceptance at depths >= 2 is higher
  than with `--no-commit-pass` (the ablation keeps chained draft entries at accepted positions).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from runtime.core.sampling import SamplingParams
from runtime.factory import create_engine

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
SNIPPETS = [
    "def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n\n\ndef ",
    "class Queue:\n    def __init__(self, maxsize=0):\n        self.maxsize = maxsize\n        self.",
    "import os\nimport sys\n\n\ndef main(argv=None):\n    if argv is None:\n        argv = sys.argv[1:]\n    ",
    "    for i, line in enumerate(lines):\n        if not line.strip():\n            continue\n        ",
]


def engine(k: int, **kw):
    opts = dict(num_draft_tokens=k, block_size=16, num_blocks=256, max_batch=4, max_num_tokens=128, max_seq_len=512)
    return create_engine(checkpoint=TINY, executor="torch", **{**opts, **kw})


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


def heldout_snippets() -> list[str]:
    """300-character windows of stdlib files the tiny model did not train on (models/tiny/training_report.json)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = ["getopt.py", "reprlib.py", "pkgutil.py", "trace.py", "bdb.py", "mailcap.py", "unittest/util.py",
             "importlib/__init__.py"]  # fmt: skip
    return [(stdlib / f).read_text()[off : off + 300] for f in files for off in (500, 3000)]


def acceptance(k: int, commit_pass: bool):
    eng = engine(k, commit_pass=commit_pass, max_batch=8, max_num_tokens=256, num_blocks=512)
    eng.generate([eng.tokenizer.encode(s).ids for s in heldout_snippets()], SamplingParams(max_tokens=128))
    return eng.metrics


def test_commit_pass_prevents_acceptance_decay():
    """Greedy, so deterministic. Measured here (K=3, 16 held-out prompts x 128 tokens, ~770 verify steps):
    unconditional per-position acceptance 0.774/0.552/0.381 with the commit pass vs 0.754/0.536/0.343
    without; conditional 0.774/0.713/0.690 vs 0.754/0.710/0.640."""
    with_commit, without = acceptance(3, True), acceptance(3, False)
    print("with commit pass:", with_commit.acceptance_rate_per_position, with_commit.conditional_acceptance_per_position)
    print("without:", without.acceptance_rate_per_position, without.conditional_acceptance_per_position)
    assert with_commit.acceptance_rate_per_position[0] > 0.5, "the trained MTP module should draft well"
    # Without the refresh, last step's accepted positions keep chained (draft-hidden) entries, and every later
    # depth attends to them: acceptance falls further behind the deeper the draft.
    for i in (1, 2):
        assert with_commit.acceptance_rate_per_position[i] > without.acceptance_rate_per_position[i]
    assert with_commit.conditional_acceptance_per_position[2] > without.conditional_acceptance_per_position[2] + 0.02
    assert with_commit.mean_acceptance_length > without.mean_acceptance_length


def test_stop_string_truncates_and_finishes():
    eng = engine(2)
    prompt = heldout_snippets()[0]
    full = eng.generate([prompt], SamplingParams(max_tokens=48))[0]
    stop = full.text[10:14]
    assert stop.strip(), "pick a non-blank stop string"
    eng = engine(2)
    out = eng.generate([prompt], SamplingParams(max_tokens=48, stop=(stop,)))[0]
    assert out.finish_reason == "stop" and out.text == full.text[: full.text.find(stop)]
    assert eng.kv.num_free_blocks == eng.cfg.num_blocks - 1
