"""The realistic-size bench: decode on a ~1.6 GB GLM-4.5-Air-shaped checkpoint, where weights do not fit in L3.

    python -m runtime.bench.realsize --llama-cpp <llama.cpp bin dir> --llama-src <llama.cpp source dir>
    (the bf16 detail: eager profile, weight-read split; `make bench-realsize` runs realsize_formats.py)

One interleaved run, 1 thread, batch 1, a short prompt (`--context` tokens already in the KV cache), medians of
`--rounds` rounds (each round rotates the order; one timing per round is the median of `--iters` calls, wall clock):
  compiled    per-forward time of our compiled engine (`--engine`, built with `mtp-build --compile aoti`: bf16 weights,
              fp32 math), and the MTP step pieces: the verify forward at 1+K rows, one draft depth, the commit pass
              over 1+K rows
  eager       the same for the torch eager executor with the C++ kernels (fp32 weights; `--no-eager` skips it)
  llama.cpp   `llama-completion` (K=0, greedy) on the bf16 GGUF of the same weights, its own eval timer per token
  bandwidth   best-of-rounds streaming read (torch sum, 1 thread) of a buffer much larger than L3
Derived: the bandwidth bound = weight bytes one decode token reads (runtime/bench/bound.py, at the bytes per weight
the engine reads) / bandwidth; ours / bound; ours / llama.cpp. MTP tokens/s are a PROJECTION: measured step costs
combined with the acceptance the deep model measured (bench_results/bench.json; random weights accept nothing real).
`profile_split` says where the time of one eager forward goes (torch profiler, self CPU time per op class).
Writes bench_results/realsize_bf16_detail.json (bench_results/realsize.json is the format bench's:
runtime/bench/realsize_formats.py, `make bench-realsize`). The checkpoint and GGUF go to build/realsize/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.config import ModelConfig
from runtime.bench.bound import forward_params
from runtime.bench.compiled_compare import step_inputs
from runtime.bench.llama_cpp import LlamaCppRunner
from runtime.bench.realsize_ckpt import DEFAULT_OUT, write_checkpoint
from runtime.executors.base import CommitInput, DraftInput

BW_BYTES = 1 << 30  # 1 GiB: 32x this machine's L3
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


def measure_bandwidth(
    nbytes: int = BW_BYTES, repeats: int = 3, clock: Callable[[], float] = time.perf_counter
) -> float:
    """Bytes per second one thread streams from DRAM: the best of `repeats` reductions of a float32 buffer much
    larger than L3, by torch and by numpy (whichever reads faster; the first touch is excluded). `clock`: wall time,
    or the thread's CPU time for a probe beside kernel timings taken that way on a loaded machine."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    a = x.numpy()
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        for fn in (x.sum, a.sum):
            t0 = clock()
            fn()
            best = min(best, clock() - t0)
    return nbytes / best


def weight_bytes_per_token(c: ModelConfig, bytes_per_param: float) -> dict[str, float]:
    """Weight bytes one decode token reads: main forward, one MTP forward, and the main forward split by kind."""
    one = forward_params(c, 1)
    h = c.hidden_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attn = c.num_hidden_layers * (h * (q + 2 * kv) + q * h)
    expert = 3 * h * c.moe_intermediate_size
    moe_layers = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    routed = moe_layers * c.num_experts_per_tok * expert
    dense = (c.num_hidden_layers - moe_layers) * 3 * h * c.intermediate_size + moe_layers * (
        c.n_shared_experts * expert + h * c.n_routed_experts)  # fmt: skip
    head = c.vocab_size * h
    return {k: v * bytes_per_param for k, v in {
        "main": one.main, "mtp": one.mtp, "attention_proj": attn, "routed_experts": routed,
        "dense_mlp_shared_router": dense, "lm_head": head}.items()}  # fmt: skip


def make_executor(checkpoint: Path, engine: Path | None):
    """(executor, bytes per weight it reads, block size, table width): the compiled engine when `engine` is given,
    else the torch eager executor with the C++ kernels (fp32 weights: the eager executor's only precision)."""
    if engine is not None:
        from runtime.executors.compiled_executor import CompiledExecutor

        ex = CompiledExecutor(engine)
        return ex, 2.0, ex.config.kv.block_size, ex.config.kv.table_width
    from models.checkpoint import load_model
    from runtime.executors.torch_executor import TorchExecutor

    model, _ = load_model(checkpoint)
    return TorchExecutor(model, num_blocks=64, block_size=16, max_batch=1, num_draft_tokens=3), 4.0, 16, 64


def step_fns(ex, c: ModelConfig, context: int, ks: list[int], block: int, width: int) -> dict[str, Callable]:
    """The timed calls, after one prefill of `context` tokens: decode (1 row), verify (1+K rows), draft, commit."""
    prefills, decode, _ = step_inputs(1, 1, context, block, width, c.vocab_size)
    for p in prefills:
        ex.run_main(p)
    fns: dict[str, Callable] = {"decode": lambda: ex.run_main(decode)}
    h = np.random.default_rng(1).standard_normal((max(ks) + 1, c.hidden_size)).astype(np.float32)
    tables = decode.block_tables
    for k in ks:
        verify = step_inputs(1, 1 + k, context, block, width, c.vocab_size)[1]
        fns[f"verify_{1 + k}"] = lambda v=verify: ex.run_main(v)
        commit = CommitInput(h[: 1 + k], np.arange(1 + k, dtype=np.int64), np.array([1 + k], np.int32),
                             np.array([context], np.int32), tables)  # fmt: skip
        fns[f"commit_{1 + k}"] = lambda ci=commit: ex.run_commit(ci)
    if c.num_mtp_modules:
        draft = DraftInput(h[:1], np.array([1], np.int64), np.array([context], np.int64), np.array([1], np.int32),
                           tables)  # fmt: skip
        fns["draft"] = lambda: ex.run_draft(draft)
    return fns


def time_call(fn: Callable, iters: int) -> float:
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def profile_split(ex, fn: Callable) -> dict[str, float]:
    """ms of one call by op class from the torch profiler's self CPU times; `host` = wall minus every op's self time
    (Python, dispatch, the executor's per-step planning). Only meaningful for the eager executor."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        fn()
        wall = (time.perf_counter() - t0) * 1e3
    split = {"gemv (aten mm/addmm/linear)": 0.0, "routed experts (mtp::moe_experts)": 0.0,
             "attention + kv write (mtp::)": 0.0, "other aten ops": 0.0}  # fmt: skip
    for e in prof.key_averages():
        ms = e.self_cpu_time_total / 1e3
        if "moe_experts" in e.key:
            split["routed experts (mtp::moe_experts)"] += ms
        elif "attention" in e.key or "kv_write" in e.key:
            split["attention + kv write (mtp::)"] += ms
        elif e.key in ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm", "aten::baddbmm"):
            split["gemv (aten mm/addmm/linear)"] += ms
        elif e.key.startswith("aten::"):
            split["other aten ops"] += ms
    split["host (python, dispatch, planning)"] = max(0.0, wall - sum(split.values()))
    split["wall"] = wall
    return {k: round(v, 3) for k, v in split.items()}


def weight_stream_split(ckpt: Path, c: ModelConfig, reps: int = 3) -> dict[str, float]:
    """ms one decode token spends on each way of reading the main forward's weight matrices, measured matrix by
    matrix on the checkpoint's own bf16 tensors (1 row; routed experts: the first top-k of each MoE layer):
    what the compiled engine does (upcast bf16 -> an fp32 copy, then an fp32 GEMV of the copy), what the eager
    executor does (fp32 GEMV of fp32 weights) and a GEMV reading the bf16 weights directly (torch's bf16 kernel)."""
    from safetensors import safe_open

    out: dict[str, float] = {}
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
            main = name == "lm_head.weight" or (m is not None and int(m.group(1)) < c.num_hidden_layers)
            e = re.search(r"experts\.(\d+)\.", name)
            if not main or (e is not None and int(e.group(1)) >= c.num_experts_per_tok) or "norm" in name:
                continue
            w = f.get_tensor(name)
            if w.dim() != 2 or w.dtype != torch.bfloat16:
                continue
            x, wf = torch.randn(1, w.shape[1]), w.float()
            fns = {"upcast bf16->fp32 copy (fresh buffer, as each compiled step does)": w.float,
                   "upcast bf16->fp32 into a reused buffer": lambda w=w, wf=wf: wf.copy_(w),
                   "fp32 gemv": lambda x=x, wf=wf: x @ wf.t(),
                   "bf16 gemv (reads bf16 directly)": lambda x=x, w=w: x.bfloat16() @ w.t()}  # fmt: skip
            for key, fn in fns.items():
                out[key] = out.get(key, 0.0) + min(time_call(fn, 1) for _ in range(reps))
    return {k: round(v, 3) for k, v in out.items()}


def deep_acceptance(bench_json: Path, ks: list[int]) -> dict[int, float]:
    """Mean acceptance length (tokens per verify step, bonus included) the deep model measured at batch 1."""
    d = json.loads(bench_json.read_text())
    out = {}
    for k in ks:
        for eng in ("torch", "compiled", "onnxruntime"):
            rec = d["tokens_per_second"].get(eng, {}).get("1", {}).get(str(k))
            if isinstance(rec, dict) and "mean_acceptance_length" in rec:
                out[k] = float(rec["mean_acceptance_length"])
                break
    return out


def project_mtp(ms: dict[str, float], accept: dict[int, float]) -> dict[str, dict]:
    """Projected tokens/s at each K: acceptance length / (verify(1+K) + K drafts + commit(1+K)). A projection."""
    out = {"0": {"step_ms": round(ms["decode"], 3), "tokens_per_step": 1.0,
                 "tokens_per_second": round(1e3 / ms["decode"], 3), "x_k0": 1.0}}  # fmt: skip
    for k, acc in accept.items():
        if f"verify_{1 + k}" not in ms or "draft" not in ms:
            continue
        step = ms[f"verify_{1 + k}"] + k * ms["draft"] + ms[f"commit_{1 + k}"]
        # x_k0_mtp_free: the same with draft and commit free, the limit as main layers grow (GLM-4.5-Air has 46
        # main layers per MTP layer; this checkpoint has 2, so its MTP module costs about half a main forward)
        out[str(k)] = {"step_ms": round(step, 3), "tokens_per_step": acc, "tokens_per_second": round(acc * 1e3 / step, 3),
                       "x_k0": round(acc * ms["decode"] / step, 3),
                       "x_k0_mtp_free": round(acc * ms["decode"] / ms[f"verify_{1 + k}"], 3)}  # fmt: skip
    return out


def _measure(args: argparse.Namespace, c: ModelConfig, ckpt: Path, gguf: Path) -> tuple[dict, dict, dict]:
    """The interleaved rounds: (per-job timings, executors by name, their bytes per weight)."""
    execs: dict[str, Any] = {}
    bpp: dict[str, float] = {}
    jobs: dict[str, Callable[[], float]] = {}
    for name, engine in [("eager", None)] * args.eager + [("compiled", args.engine)] * (args.engine is not None):
        t0 = time.perf_counter()
        ex, bpp[name], block, width = make_executor(ckpt, engine)
        print(f"{name}: ready in {time.perf_counter() - t0:.1f}s", flush=True)
        execs[name] = (ex, step_fns(ex, c, args.context, args.ks, block, width))
        for n, f in execs[name][1].items():
            jobs[f"{name} {n}"] = partial(time_call, f, args.iters)
    if args.llama_cpp:
        llama = LlamaCppRunner(args.llama_cpp, gguf, 1, 256)

        def llama_ms() -> float:
            o = llama.run_one(PROMPT, 0, args.llama_tokens)
            return o.decode_seconds / o.decode_tokens * 1e3

        jobs["llama.cpp decode"] = llama_ms
    jobs["bandwidth GB/s"] = lambda: measure_bandwidth() / 1e9
    times: dict[str, list[float]] = {n: [] for n in jobs}
    names = list(jobs)
    for rnd in range(args.rounds):
        for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
            times[name].append(jobs[name]())
        print(f"round {rnd + 1}/{args.rounds}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in times.items()), flush=True)
    return times, execs, bpp


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    ckpt = write_checkpoint(args.checkpoint)
    gguf = args.gguf or ckpt.parent / f"{ckpt.name}-bf16.gguf"
    if args.llama_cpp and not gguf.is_file():
        if not args.llama_src:
            raise SystemExit(f"{gguf} missing: pass --llama-src <llama.cpp source dir> to convert the checkpoint")
        subprocess.run([sys.executable, "-m", "runtime.bench.gguf", "--checkpoint", str(ckpt), "--llama-src",
                        str(args.llama_src), "--outfile", str(gguf)], check=True)  # fmt: skip
    c = ModelConfig.from_hf_dict(json.loads((ckpt / "config.json").read_text()))
    times, execs, bpp = _measure(args, c, ckpt, gguf)
    med = {n: statistics.median(v) for n, v in times.items()}
    bw = max(times["bandwidth GB/s"]) * 1e9
    wb16 = weight_bytes_per_token(c, 2.0)
    bound16 = wb16["main"] / bw * 1e3
    res: dict[str, Any] = {
        "command": " ".join(["python -m runtime.bench.realsize", *sys.argv[1:]]),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpu": platform.processor() or platform.machine(), "isa": torch.ops.mtp.cpu_isa(),
                    "load_average": [round(x, 2) for x in os.getloadavg()]},  # fmt: skip
        "model": {"checkpoint": str(ckpt), "checkpoint_bytes": (ckpt / "model.safetensors").stat().st_size,
                  "shapes": "GLM-4.5-Air layer shapes; 2 main layers (1 dense + 1 MoE) + 1 MTP, 8 experts top-4, "
                            "vocab 2048 (runtime/bench/realsize_ckpt.py)",
                  "config": {k: getattr(c, k) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                             "head_dim", "intermediate_size", "moe_intermediate_size", "n_routed_experts",
                             "num_experts_per_tok", "n_shared_experts", "num_hidden_layers", "vocab_size")}},  # fmt: skip
        "settings": {"threads": 1, "batch": 1, "context": args.context, "rounds": args.rounds, "iters": args.iters,
                     "llama_tokens": args.llama_tokens, "clock": "wall (perf_counter), medians over rounds"},  # fmt: skip
        "times_ms_median": {n: round(v, 3) for n, v in med.items()},
        "times_all": {n: [round(x, 3) for x in v] for n, v in times.items()},
        "bandwidth_gb_s_best": round(bw / 1e9, 2),
        "weight_bytes_per_decode_token_bf16": {k: round(v) for k, v in wb16.items()},
        "bound_ms_bf16": round(bound16, 3),
        "bound_ms": {},
        "ours": {},
    }
    if "llama.cpp decode" in med:
        res["llama_cpp_over_bf16_bound"] = round(med["llama.cpp decode"] / bound16, 3)
    accept = deep_acceptance(args.acceptance_from, args.ks) if args.acceptance_from.is_file() else {}
    res["mtp_acceptance_from_deep_model"] = {"source": f"{args.acceptance_from} (batch 1)", "length": accept}
    for name, (ex, fns) in execs.items():
        ms = {n.split(" ", 1)[1]: v for n, v in med.items() if n.startswith(name + " ")}
        bound = weight_bytes_per_token(c, bpp[name])["main"] / bw * 1e3
        res["bound_ms"][name] = round(bound, 3)
        r = {"bytes_per_weight": bpp[name], "decode_ms": round(ms["decode"], 3), "over_bound": round(ms["decode"] / bound, 3),
             "over_bf16_bound": round(ms["decode"] / bound16, 3),
             "mtp_projection": {"label": "PROJECTION from measured step costs and the deep model's acceptance; "
                                         "not a measured MTP run", "per_k": project_mtp(ms, accept)}}  # fmt: skip
        if "llama.cpp decode" in med:
            r["over_llama_cpp"] = round(ms["decode"] / med["llama.cpp decode"], 3)
        if name == "eager":
            r["profile_split_decode_ms"] = profile_split(ex, fns["decode"])
        res["ours"][name] = r
    if args.engine is not None:
        res["weight_read_split_decode_ms"] = weight_stream_split(ckpt, c)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_OUT, help="written first if missing")
    p.add_argument("--engine", type=Path, help="a `mtp-build --compile aoti` engine of the checkpoint (measured beside "
                   "the torch eager executor with the C++ kernels)")  # fmt: skip
    p.add_argument("--no-eager", dest="eager", action="store_false", help="skip the torch eager executor")
    p.add_argument("--llama-cpp", type=Path, help="llama.cpp bin dir (llama-completion); omit to skip llama.cpp")
    p.add_argument("--llama-src", type=Path, help="llama.cpp source (convert_hf_to_gguf.py), to write the GGUF")
    p.add_argument("--gguf", type=Path, help="default: <checkpoint>-bf16.gguf beside the checkpoint")
    p.add_argument("--context", type=int, default=32, help="prompt tokens in the KV cache before the timed step")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--llama-tokens", type=int, default=16)
    p.add_argument("--acceptance-from", type=Path, default=Path("bench_results/bench.json"))
    p.add_argument("--output", type=Path, default=Path("bench_results/realsize_bf16_detail.json"))
    args = p.parse_args(argv)
    res = run(args)
    args.output.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: res[k] for k in ("times_ms_median", "bandwidth_gb_s_best", "bound_ms_bf16", "ours")}, indent=1))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
