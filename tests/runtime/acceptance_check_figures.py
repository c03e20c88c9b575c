"""Reproduces the self-check table of docs/RUNTIME.md "Acceptance guards": PYTHONPATH=. python tests/runtime/acceptance_check_figures.py models/deep 3"""
import dataclasses
import sys

import numpy as np

from runtime.core.self_check import run_self_check
from runtime.factory import create_engine


class WrongHidden:
    """plant: zero -> depth 0..K-1 get zeros; noise -> standard normal; (the executor is otherwise real)"""
    def __init__(self, ex, how): self.ex, self.how, self.g = ex, how, np.random.default_rng(0)
    def __getattr__(self, n): return getattr(self.ex, n)
    def run_draft(self, inp):
        h = np.zeros_like(inp.hidden_in) if self.how == "zero" else self.g.standard_normal(inp.hidden_in.shape).astype(np.float32)
        return self.ex.run_draft(dataclasses.replace(inp, hidden_in=h))

ck, k = sys.argv[1], int(sys.argv[2])
for plant in ("none", "zero", "noise"):
    e = create_engine(checkpoint=ck, executor="torch", num_draft_tokens=k,
                      wrap_executor=None if plant == "none" else (lambda ex, p=plant: WrongHidden(ex, p)))
    run_self_check(e)  # warm the executor once (first-call costs), then time the second run
    res, secs = run_self_check(e)
    print(f"{ck} K={k} plant={plant}: verdict={res.verdict} measured={res.measured:.3f} floor={res.floor:.3f} "
          f"drafted={res.drafted} cost={secs*1000:.0f} ms", flush=True)
