"""What the quantized engines' EP2 tests (test_int8_quantize.py, test_fp8_native.py) read: each rank's package as
stored (its constants' dtypes and bytes, the mtp ops it calls) and greedy decoding of an engine under a real mpirun
against the single-rank engine of the same format.

An AOTInductor package keeps its weights inside its .so; the wrapper source beside it declares each one
(`constants_info_[i]`: original_fqn, dtype, shape, data_size) and the wrapper's JSON lists the custom-op calls the
proxy executor makes: both are read from the package file itself, not from the builder's record.
"""

from __future__ import annotations

import json
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

from runtime.core.sampling import SamplingParams
from runtime.factory import create_engine
from tests.mpi_launch import run_mpi
from tests.runtime.mpi_tp_worker import SETTINGS, prompts

EP2_FLAGS = ("--compile", "aoti", "--world-size", "2", "--ep-size", "2")
# One launch runs K=0 and K=2 (the builds' num_draft_tokens) on two ranks loading compiled packages: ~1 min idle,
# a few on the loaded 2-core machine; past this the ranks are killed and the test fails.
EP2_RUN_TIMEOUT_S = 600
MAX_TOKENS = 12  # mpi_tp_worker's


@dataclass(frozen=True)
class Constant:
    dtype: str  # torch's name: "int8", "uint8", "float32", "float8_e4m3fn", ...
    shape: tuple[int, ...]
    nbytes: int


def _member(package: Path, suffix: str) -> str:
    with zipfile.ZipFile(package) as z:
        (name,) = [n for n in z.namelist() if n.endswith(suffix)]
        return z.read(name).decode()


def package_constants(package: Path) -> dict[str, Constant]:
    """The weights a package stores, by their model name (`model.layers.1.mlp.w_gate_up`, ...)."""
    src = _member(package, ".wrapper.cpp")
    fields: dict[str, dict[str, str]] = {}
    for i, key, value in re.findall(r"constants_info_\[(\d+)\]\.(\w+) = (.*);", src):
        fields.setdefault(i, {})[key] = value
    out = {}
    for f in fields.values():
        shape = tuple(int(d) for d in f["shape"].strip("{}").split(",") if d.strip())
        out[f["original_fqn"].strip('"')] = Constant(f["dtype"].removeprefix("cached_torch_dtype_"), shape,
                                                     int(f["data_size"]))  # fmt: skip
    return out


def package_ops(package: Path) -> set[str]:
    """The custom ops the package calls through the proxy executor (`mtp::moe_experts_int8_exchange`, ...)."""
    return {n["node"]["target"] for n in json.loads(_member(package, ".wrapper.json"))["nodes"]}


def ep2_outputs(engine: Path, out: Path) -> dict[str, dict]:
    """tests/runtime/mpi_tp_worker.py on `engine` under `mpirun -np 2` (EP2, no TP: each rank a DP leader serving
    its share; chunked prefill in 8-token chunks, a shared prefix, late arrivals) at K=0 and K=2: {"0": results,
    "2": results} as the worker writes them."""
    code, output = run_mpi(2, "tests.runtime.mpi_tp_worker", str(engine), str(out), "ok", "1", "2", "0,2",
                           timeout=EP2_RUN_TIMEOUT_S)  # fmt: skip
    assert code == 0, output[-3000:]
    return json.loads(out.read_text())


def single_rank_outputs(engine: Path) -> dict[str, list[int]]:
    """The single-rank engine's greedy ids at K=0 for the worker's requests, by its request ids."""
    eng = create_engine(engine, num_draft_tokens=0, max_prefill_chunk=SETTINGS["max_prefill_chunk"])
    first, late = prompts(min(96, eng.model_cfg.vocab_size))  # as the worker draws them
    outs = eng.generate(first + late, SamplingParams(max_tokens=MAX_TOKENS))
    ids = [f"a{i}" for i in range(len(first))] + [f"b{i}" for i in range(len(late))]
    return {i: o.output_ids for i, o in zip(ids, outs, strict=True)}


def assert_ep2_equals_single_rank(ep2: Path, single: Path, out: Path) -> None:
    """Greedy K=2 of the EP2 engine under mpirun equals its K=0, and both equal the single-rank engine of the same
    format at K=0 (token for token: the same quantized weights; the exchange only reorders the experts' sum)."""
    want = single_rank_outputs(single)
    results = ep2_outputs(ep2, out)
    assert sorted(results) == ["0", "2"]
    for k, res in results.items():
        assert res["executors"] == ["CompiledExecutor"] * 2, k
        assert res["outputs"] == want, f"K={k}"
        assert res["prefix_hit_tokens"] > 0, k
        assert min(res["collective_seconds"]) > 0, k  # the packages really exchanged tokens
