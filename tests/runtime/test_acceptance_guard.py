"""Acceptance guards (docs/RUNTIME.md "Acceptance guards"): the start-up self-check reports a planted bug (a draft
module fed the wrong hidden state) and stays silent without it; the running collapse detector warns once when a
window's acceptance falls far below the running average, as a pure function and end to end."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest

from models.checkpoint import load_model
from runtime.core.acceptance_guard import POSITION_FLOORS, CollapseDetector, evaluate_self_check
from runtime.core.config import ConfigError, RuntimeConfig
from runtime.core.engine import LLMEngine
from runtime.core.sampling import SamplingParams
from runtime.core.self_check import start_up_check
from runtime.executors.torch_executor import TorchExecutor
from runtime.factory import load_tokenizer

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"


# ------------------------------------------------------------------ the running detector, pure
def feed(det: CollapseDetector, rates: list[float], drafted: int = 4) -> list[str]:
    """One verify per rate: `drafted` drafts, round(rate * drafted) accepted; the warning lines it returned."""
    lines = [det.observe(drafted, round(r * drafted)) for r in rates]
    return [x for x in lines if x is not None]


def test_steady_acceptance_never_warns():
    assert feed(CollapseDetector(window=32, warmup=64), [0.5, 0.75] * 500) == []


def test_a_collapse_after_warmup_warns_once_and_names_the_rates():
    det = CollapseDetector(window=32, warmup=64)
    assert feed(det, [0.75] * 40) == []
    lines = feed(det, [0.0] * 400)  # 50 windows collapsed: one line, not one per window
    assert len(lines) == 1 and det.num_warnings == 1
    assert "collapsed: 0.000" in lines[0] and "running average 0.750" in lines[0] and "hidden state" in lines[0]


def test_the_warning_rearms_only_after_recovery():
    det = CollapseDetector(window=32, warmup=64)
    feed(det, [0.75] * 40)
    assert len(feed(det, [0.0] * 16)) == 1
    assert feed(det, [0.25] * 16) == []  # above a third of the average but below 2/3: still collapsed, no repeat
    assert feed(det, [0.75] * 16) == []  # recovered: re-armed
    assert len(feed(det, [0.0] * 16)) == 1 and det.num_warnings == 2


def test_no_warning_before_warmup_nor_for_a_mild_dip():
    assert feed(CollapseDetector(window=32, warmup=256), [0.75] * 24 + [0.0] * 24) == []  # collapse inside warm-up
    assert feed(CollapseDetector(window=32, warmup=64), [0.75] * 40 + [0.5] * 400) == []  # 2/3 of the average


# ------------------------------------------------------------------ the self-check verdict, pure
def test_self_check_verdict_from_counts():
    low = evaluate_self_check([40, 40, 40], [8, 2, 0])  # positions 1-2 judged: 10 / 80
    assert (low.verdict, low.positions, low.drafted, low.measured) == ("low", 2, 80, 0.125)
    assert low.floor == pytest.approx(sum(POSITION_FLOORS) / 2)
    line = low.line("mtp-run")
    assert line.startswith("mtp-run: warning: acceptance self-check: MTP acceptance 0.12") and "\n" not in line
    assert "expected >= 0.33" in line and "wrong hidden state" in line and "quantized MTP head" in line
    assert evaluate_self_check([40], [30]).verdict == "ok"
    assert evaluate_self_check([40], [15]).verdict == "low"  # K=1: position 1's floor alone
    assert evaluate_self_check([10, 10], [0, 0]).verdict == "inconclusive"  # too few drafts to judge


# ------------------------------------------------------------------ end to end on the trained tiny model
class WrongDraftInput:
    """The planted bugs, switched by `on`: "hidden" feeds every draft depth zeros for the hidden state; "token"
    feeds it the wrong token (id + 1: a mismatched embedding). Everything else runs for real."""

    def __init__(self, inner: TorchExecutor) -> None:
        self.inner, self.on = inner, ""

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def run_draft(self, inp):
        if self.on == "hidden":
            inp = dataclasses.replace(inp, hidden_in=np.zeros_like(inp.hidden_in))
        elif self.on == "token":
            inp = dataclasses.replace(inp, token_ids=(inp.token_ids + 1) % self.inner.vocab_size)
        return self.inner.run_draft(inp)


@pytest.fixture(scope="module")
def tiny():
    model, _ = load_model(TINY)
    cfg = RuntimeConfig(max_batch=4, max_num_tokens=64, max_seq_len=160, block_size=16, num_blocks=64,
                        num_draft_tokens=1, enable_prefix_caching=False)  # fmt: skip
    plant = WrongDraftInput(TorchExecutor(model, cfg.num_blocks, cfg.block_size))
    engine = LLMEngine(plant, model.cfg, cfg, load_tokenizer(TINY),
                       acceptance_watch=CollapseDetector(window=48, warmup=96))  # fmt: skip
    return engine, plant


def test_self_check_reports_a_draft_module_fed_the_wrong_hidden_state(tiny, capsys):
    engine, plant = tiny
    plant.on = ""
    good = start_up_check(engine, "warn", "mtp-run")
    assert good is not None and good.verdict == "ok" and capsys.readouterr().err == ""  # silent when correct
    plant.on = "hidden"
    try:
        bad = start_up_check(engine, "warn", "mtp-run")
        err = capsys.readouterr().err
        with pytest.raises(ConfigError, match=r"^mtp-run: acceptance self-check: MTP acceptance 0\.\d\d"):
            start_up_check(engine, "strict", "mtp-run")
    finally:
        plant.on = ""
    assert bad is not None and bad.verdict == "low" and bad.measured < good.measured / 2
    assert err.count("\n") == 1 and "implausibly low" in err and f"{bad.measured:.2f}" in err
    assert start_up_check(engine, "off", "mtp-run") is None and engine.metrics.num_verify_steps == 0


def test_running_detector_warns_once_when_the_draft_input_breaks_mid_run(tiny, caplog):
    """On free-running prompts this model's greedy output repeats itself, so even zero-hidden drafts keep 0.48 of
    0.78 acceptance (no collapse); a mismatched embedding (the "token" plant) collapses it, as in the field."""
    engine, plant = tiny
    engine.reset_metrics()
    prompts = [list(engine.tokenizer.encode(t).ids) for t in ("def main(", "import os\n", "class A:\n", "x = [")]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    with caplog.at_level(logging.WARNING, logger="mtp.acceptance"):
        clean = engine.generate(prompts, params)  # warm-up: the running average of a correct module
        assert caplog.records == [] and engine.acceptance_watch.drafted >= engine.acceptance_watch.warmup
        plant.on = "token"
        try:
            broken = engine.generate(prompts * 2, params)
        finally:
            plant.on = ""
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "draft acceptance collapsed" in warnings[0], warnings
    assert engine.acceptance_watch.num_warnings == 1
    # the guard only observes: greedy output is the main model's, broken drafts or not
    assert [o.output_ids for o in broken[:4]] == [o.output_ids for o in clean]
