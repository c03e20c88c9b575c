"""A rank's compiled packages hold their weights in memory once: loading a package adds about its weight bytes to the
process's resident memory, at the peak too, and loading a second package of the same rank that uses the same weights
adds almost nothing: both read the rank's one weight store, mapped once (builder/pool_weights.py,
models/engine_format/weight_store.py). With the weights inside the package's .so, the loader copied them to the
heap and the .so's pages of them stayed resident as well (2x); with a copy in each package (data/weights/), each
package loaded its own (2x for two).

Two packages of the same 16 weights of 4 MiB (a model's many weights, none of them most of its bytes, as main and
draft share the embedding and LM head), compiled as an engine graph is, pooled as a build pools a rank's, and loaded
one after the other in a fresh process, after a copy of the rank has been loaded (it maps the libraries every package
shares), as ratios to the weight bytes, so the figures do not depend on a quiet machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from builder.compile_aoti import compile_graph
from builder.pool_weights import pool_rank_weights
from models.engine_format.weight_store import STORE_NAME

ROOT = Path(__file__).resolve().parents[2]
WEIGHTS, ROWS = 16, 1024  # 16 fp32 [1024, 1024] weights: 4 MiB each, 64 MiB in all


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.ParameterList(nn.Parameter(torch.randn(ROWS, ROWS) / ROWS**0.5) for _ in range(WEIGHTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.w:
            x = x @ w
        return x


# The measuring process: RSS (VmRSS) and its peak (VmHWM, reset by /proc/self/clear_refs) around each load + run.
MEASURE = """
import json, sys, torch
from pathlib import Path
import models.engine_format.compiled as compiled  # the loader's imports, before the first measure

def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key + ":"))

class Where:  # load_package's `cfg`: only its path (in error lines)
    path = Path(sys.argv[1]).parent

x = torch.randn(2, 1024)
compiled.load_package(Where, Path(sys.argv[1]))(x)  # maps the libraries every package shares (not measured)
got, outs = {}, []
for name in sys.argv[2:]:
    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak restarts from here
    outs.append(compiled.load_package(Where, Path(name))(x))
    got[Path(name).name] = {"grew": status("VmRSS") - before, "peak": status("VmHWM") - before}
print(json.dumps({**got, "same": bool(torch.equal(outs[0], outs[1]))}))
"""


def test_packages_of_a_rank_hold_their_weights_once(tmp_path):
    torch.manual_seed(0)
    stack = Stack().eval()  # one set of weights for both packages
    program = lambda: torch.export.export(stack, (torch.randn(2, ROWS),))  # noqa: E731
    paths = [tmp_path / f"{name}.aoti.pt2" for name in ("first", "second")]
    weight_bytes = WEIGHTS * ROWS * ROWS * 4
    for path in paths:
        record = compile_graph(path.stem, None, None, 0, path, "float32", export=program)  # type: ignore[arg-type]
        assert record["weight_bytes"] == weight_bytes
    pooled = pool_rank_weights(tmp_path, paths)
    assert pooled == {"package_weight_bytes": 2 * weight_bytes, "store_bytes": weight_bytes}
    warm = tmp_path / "warm"  # a copy of the rank (another store file: mapped on its own) that the process loads first
    warm.mkdir()
    for f in (paths[0], tmp_path / STORE_NAME):
        shutil.copyfile(f, warm / f.name)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(warm / paths[0].name), *map(str, paths)], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    ratios = {f"{p.stem} {k}": got[p.name][k] / weight_bytes for p in paths for k in ("grew", "peak")}
    print(json.dumps({"weight_bytes": weight_bytes, **got, "ratios": ratios}))  # for the record (pytest -s)
    assert got["same"]  # the second package computes what the first does, from the same mapped weights
    assert ratios["first.aoti grew"] <= 1.3 and ratios["first.aoti peak"] <= 1.3, ratios
    assert ratios["second.aoti grew"] <= 0.2 and ratios["second.aoti peak"] <= 0.2, ratios
