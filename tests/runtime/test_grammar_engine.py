"""runtime/core/grammar.py in the engine (in process, models/tiny, torch): drafts the grammar rejects are cut before
verification and the matcher is rolled back to the last emitted token; sampled decoding under a grammar stays
valid with both acceptance rules; greedy output equals MTP off with `auto` draft length too."""

from __future__ import annotations

import json

import numpy as np
import pytest

from runtime.core import grammar
from runtime.core.grammar import GrammarCompiler
from runtime.core.request import Request
from runtime.core.sampling import SamplingParams
from runtime.factory import create_engine
from tests.runtime.openai_helpers import TINY

pytestmark = pytest.mark.timeout(600)
SCHEMA = {"type": "object", "properties": {"k": {"enum": ["ab", "cd"]}, "n": {"type": "integer", "minimum": 0,
                                                                                "maximum": 99}},
          "required": ["k", "n"], "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def engines():
    on = create_engine(checkpoint=TINY, executor="torch", num_draft_tokens=3)
    return on, GrammarCompiler(on.tokenizer, on.model_cfg.vocab_size, on.model_cfg.eos_token_id)


def test_rejected_drafts_are_cut_and_the_matcher_rolls_back(engines):
    engine, compiler = engines
    g = compiler.choice(["yes"])
    yes = list(engine.tokenizer.encode("yes").ids)
    req = Request("r", [1, 2], SamplingParams(grammar=g), 0, np.random.default_rng(0))
    eos = engine.model_cfg.eos_token_id[0]
    for t in [*yes, eos, 7]:  # "yes", the end, then a draft past the end of the grammar
        req.spec.drafts.append(t)
        grammar.push_draft(req, t)
    grammar.end_drafts(req)
    assert req.spec.drafts == [*yes, eos]  # the draft the grammar rejects is cut before verification
    m = req.matcher.matcher  # rolled back: the matcher is where the last emitted token left it (the start)
    assert not m.is_terminated() and all(m.accept_token(t) for t in yes)
    wrong = Request("w", [1, 2], SamplingParams(grammar=g), 0, np.random.default_rng(0))
    for t in [7, *yes]:
        wrong.spec.drafts.append(t)
        grammar.push_draft(wrong, t)
    grammar.end_drafts(wrong)
    assert wrong.spec.drafts == []


def test_verify_rows_are_masked_per_position(engines):
    engine, compiler = engines
    g = compiler.choice(["yes"])
    yes = list(engine.tokenizer.encode("yes").ids)
    req = Request("r", [1, 2], SamplingParams(grammar=g), 0, np.random.default_rng(0))
    rows = np.zeros((len(yes) + 1, engine.model_cfg.vocab_size), np.float32)
    masked = grammar.mask_verify_rows(req, rows, yes)
    dec = engine.tokenizer.decode
    for i, t in enumerate(yes):  # row i allows the next token of "yes" and only tokens that continue "yes" there
        allowed = np.flatnonzero(np.isfinite(masked[i])).tolist()
        rest = "yes"[len(dec(yes[:i])) :]
        assert t in allowed and all(dec([a]) and rest.startswith(dec([a])) for a in allowed), (i, allowed)
    assert np.flatnonzero(np.isfinite(masked[-1])).tolist() == list(engine.model_cfg.eos_token_id)
    assert all(req.matcher.matcher.accept_token(t) for t in yes)  # the verify pass rolled back too


@pytest.mark.parametrize("acceptance", ["exact", "rejection"])
def test_sampled_outputs_under_a_grammar_validate(engines, acceptance):
    engine, compiler = engines
    g = compiler.json_schema(SCHEMA)
    prompts = ["def main(", "import os\n", "x = ", "{"]
    for seed in range(3):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=64, grammar=g, acceptance=acceptance)
        for out in engine.generate(prompts, params):
            value = json.loads(out.text)
            assert value["k"] in ("ab", "cd") and 0 <= value["n"] <= 99 and set(value) == {"k", "n"}


def test_greedy_under_a_grammar_equals_mtp_off_with_auto_draft_length(engines):
    _, compiler = engines
    g = compiler.json_schema(SCHEMA)
    auto = create_engine(checkpoint=TINY, executor="torch", num_draft_tokens="auto")
    off = create_engine(checkpoint=TINY, executor="torch", num_draft_tokens=0)
    prompts = ["def main(", "import os\n", "class A:"]
    params = SamplingParams(max_tokens=64, grammar=g)
    assert [o.output_ids for o in auto.generate(prompts, params)] == [o.output_ids for o in off.generate(prompts, params)]
