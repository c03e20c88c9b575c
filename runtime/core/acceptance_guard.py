"""Guards against silent acceptance collapse, pure: the start-up self-check's verdict and the running detector.

The commonest MTP bug ships no error: a draft module fed the wrong hidden state (or wrong weights, a mismatched
embedding, a broken quantized head) still drafts, the main model rejects nearly everything, and output stays
correct (verification is lossless), only slow. Two guards make that visible (docs/RUNTIME.md "Acceptance guards"):

* `evaluate_self_check`: the start-up self-check (runtime/core/self_check.py drafts on the built-in repetitive
  prompts below) gives per-position counts; this turns them into one verdict line.
* `CollapseDetector`: fed each verify's drafted/accepted counts while serving; one warning when a window's
  acceptance falls far below the engine's own running average, re-armed only after it recovers.

Both are functions of counts only (no engine, no clock), so they are tested on synthetic sequences.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

_log = logging.getLogger("mtp.acceptance")

# The built-in prompts: short code-like lines repeated (the shipped models are trained on Python). Chosen from
# measurements (docs/RUNTIME.md "Acceptance guards"): on them a correctly wired MTP module of models/tiny and
# models/deep accepts about twice what the same module accepts when fed a zero or random hidden state.
SELF_CHECK_TEXTS = ("x = x + 1\n" * 10, "print('hello')\n" * 8, "def f(x):\n    return x\n" * 6,
                    "if x:\n    y = 1\nelse:\n    y = 2\n" * 3)  # fmt: skip
SELF_CHECK_MAX_TOKENS = 40
# `--acceptance-check` of mtp-run and mtp-serve: its choices and default, read by both (runtime/core/self_check.py)
CHECK_MODES = ("warn", "strict", "off")
DEFAULT_CHECK_MODE = "warn"
# Per draft position (1, 2): the floor below which acceptance is implausible for a trained, correctly wired MTP
# module. Measured on the built-in prompts (K=3): position 1 correct 0.61-0.68, zero/random hidden 0.16-0.31;
# position 2 correct 0.30-0.46, broken 0.03-0.12. Deeper positions are not judged (too model-dependent).
POSITION_FLOORS = (0.45, 0.20)
MIN_DRAFTED = 24  # fewer drafts than this (e.g. every prompt stopped at once): no verdict
LIKELY_CAUSES = ("the wrong hidden state fed to the MTP layer (position, layer, pre/post final norm)",
                 "a wrong weight mapping of the MTP module", "a tokenizer or embedding that does not match the model",
                 "a quantized MTP head")  # fmt: skip


def self_check_prompts(tokenizer, vocab_size: int) -> list[list[int]]:
    """The built-in prompts as token ids: the texts through the model's tokenizer, else repeated id patterns."""
    if tokenizer is not None:
        return [list(tokenizer.encode(t).ids) for t in SELF_CHECK_TEXTS]
    return [[(step * i + 3) % vocab_size for i in range(period)] * (48 // period)
            for step, period in ((7, 5), (13, 8), (5, 3), (11, 6))]  # fmt: skip


@dataclass(frozen=True, slots=True)
class SelfCheckResult:
    verdict: str  # "ok" | "low" | "inconclusive"
    measured: float  # acceptance over the judged positions (accepted / proposed)
    floor: float  # the mean of the judged positions' floors
    positions: int  # draft positions judged (1..positions)
    drafted: int  # drafts proposed at the judged positions

    def line(self, prog: str) -> str:
        """One line for the log: the measurement, the floor and, when low, the likely causes."""
        got = f"MTP acceptance {self.measured:.2f} at draft positions 1..{self.positions} ({self.drafted} drafts)"
        if self.verdict == "inconclusive":
            return f"{prog}: acceptance self-check inconclusive: only {self.drafted} drafts were proposed"
        if self.verdict == "ok":
            return f"{prog}: acceptance self-check ok: {got}, expected floor {self.floor:.2f}"
        return (f"{prog}: warning: acceptance self-check: {got} is implausibly low for a trained MTP module (expected "
                f">= {self.floor:.2f}); likely causes: {'; '.join(LIKELY_CAUSES)}. Output stays correct (verification "
                "is lossless), only slower; --acceptance-check off skips this check")  # fmt: skip


def evaluate_self_check(proposed: list[int], accepted: list[int]) -> SelfCheckResult:
    """The verdict from the self-check's per-position counts (position i+1 at index i)."""
    n = min(len(POSITION_FLOORS), len(proposed))
    drafted, hit = sum(proposed[:n]), sum(accepted[:n])
    floor = sum(POSITION_FLOORS[:n]) / n if n else 0.0
    measured = hit / drafted if drafted else 0.0
    if drafted < MIN_DRAFTED:
        return SelfCheckResult("inconclusive", measured, floor, n, drafted)
    return SelfCheckResult("ok" if measured >= floor else "low", measured, floor, n, drafted)


@dataclass(slots=True)
class CollapseDetector:
    """Windows of `window` drafted tokens, judged against the running average of the windows before them.

    After `warmup` drafted tokens, a window whose acceptance is below `ratio` x the running average warns once;
    it warns again only after a window at or above `rearm` x the average (hysteresis), so a lasting collapse is
    one line, not one per step. A collapsed window still joins the average: a long collapse lowers the bar
    slowly, and a window at 2/3 of the lowered average counts as recovered.
    """

    window: int = 256
    warmup: int = 1024
    ratio: float = 1 / 3
    rearm: float = 2 / 3
    drafted: int = 0  # before the current window
    accepted: int = 0
    win_drafted: int = 0
    win_accepted: int = 0
    armed: bool = True
    num_warnings: int = 0

    def observe(self, drafted: int, accepted: int) -> str | None:
        """Add one verify's counts; the warning line when this completes a window that collapsed."""
        self.win_drafted += drafted
        self.win_accepted += accepted
        if self.win_drafted < self.window:
            return None
        rate = self.win_accepted / self.win_drafted
        average = self.accepted / self.drafted if self.drafted else 0.0
        warm = self.drafted >= self.warmup and average > 0.0
        self.drafted, self.accepted = self.drafted + self.win_drafted, self.accepted + self.win_accepted
        self.win_drafted = self.win_accepted = 0
        if warm and self.armed and rate < self.ratio * average:
            self.armed = False
            self.num_warnings += 1
            return (f"warning: draft acceptance collapsed: {rate:.3f} over the last {self.window}+ drafted tokens, "
                    f"running average {average:.3f}; output stays correct, only slower. Likely causes: "
                    f"{'; '.join(LIKELY_CAUSES)}, or a workload the MTP module was not trained on")  # fmt: skip
        if not self.armed and rate >= self.rearm * average:
            self.armed = True
        return None

    def reset(self) -> None:
        """Forget the running average (the engine's metrics were reset: a new measurement starts)."""
        self.drafted = self.accepted = self.win_drafted = self.win_accepted = self.num_warnings = 0
        self.armed = True

    def feed(self, drafted: int, accepted: int) -> None:
        """observe, logging the warning (logger "mtp.acceptance"; stderr when logging is not configured)."""
        if drafted and (line := self.observe(drafted, accepted)) is not None:
            _log.warning(line)
