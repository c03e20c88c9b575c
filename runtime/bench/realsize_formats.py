"""The realistic-size format bench: bf16, fp8, int8 and int4 engines of the ~1.6 GB GLM-4.5-Air-shaped checkpoint
against llama.cpp on the same weights (BF16, Q8_0, Q4_0, Q4_K_M), at 1 and 2 threads.

    python -m runtime.bench.realsize_formats --llama-cpp build/peers/llama-build/bin \\
        --llama-src build/peers/llama_cpp_python-0.3.36/vendor/llama.cpp          (make bench-realsize)

Per thread count, one phase: every format's compiled engine in its own process (runtime/bench/realsize_worker.py:
its peak RSS is its own), llama-completion (K=0, greedy, its own eval timer) once per quant and round as a child
process (peak RSS from wait4), and the read bandwidth probe, interleaved in `--rounds` rotated rounds; medians over
rounds (each of ours is itself the median of `--iters` wall-clock calls). Derived per format (runtime/bench/
realsize_plan.py): the bandwidth bound (weight bytes one decode token reads in that format / the best measured
bandwidth; llama.cpp's from its GGUF's own tensor bytes), ours / bound, ours / llama.cpp, engine and GGUF size on disk,
the verify (2-4 rows), draft and commit costs, and the MTP speed-up at the bench's depth and PROJECTED to GLM-4.5-Air's
46 layers, both with the deep model's acceptance (random weights accept nothing real). Writes bench_results/
realsize.json, the table in docs/BENCHMARKS.md and bench_results/realsize.png (runtime/bench/realsize_report.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from models.config import ModelConfig
from runtime.bench import realsize_plan as plan
from runtime.bench.llama_cpp import (
    LOST_LOG_RETRIES,
    TIMEOUT_S,
    LlamaCppError,
    LlamaCppRunner,
    LlamaOutput,
    parse_completion,
)
from runtime.bench.realsize import PROMPT, deep_acceptance, measure_bandwidth
from runtime.bench.realsize_report import write_outputs
from runtime.bench.realsize_worker import EngineWorker

BUILD_DIR = Path("build/realsize")


class BenchSetupError(Exception):
    """Something the bench needs is missing (one line, with the command that makes it)."""


def gguf_for(build: Path, quant: str) -> Path:
    return build / f"air2-{quant.lower()}.gguf"


def ensure_ggufs(build: Path, llama_bin: Path, llama_src: Path | None, quants: list[str]) -> dict[str, Path]:
    """The BF16 GGUF by llama.cpp's converter (runtime/bench/gguf.py), the others by llama-quantize from it."""
    bf16 = gguf_for(build, "BF16")
    if not bf16.is_file():
        if llama_src is None:
            raise BenchSetupError(f"{bf16} missing: pass --llama-src <llama.cpp source dir> to convert the checkpoint")
        subprocess.run([sys.executable, "-m", "runtime.bench.gguf", "--checkpoint", str(build / "air2"),
                        "--llama-src", str(llama_src), "--outfile", str(bf16)], check=True)  # fmt: skip
    out = {}
    for q in quants:
        path = gguf_for(build, q)
        if not path.is_file():
            tool = llama_bin / "llama-quantize"
            if not tool.is_file():
                raise BenchSetupError(f"{tool} missing: `make bench-realsize` builds it (LLAMA_BINS)")
            subprocess.run([str(tool), str(bf16), str(path), q, "2"], check=True, stdout=subprocess.DEVNULL)
        out[q] = path
    return out


def gguf_read_bytes(path: Path, llama_src: Path | None, c: ModelConfig) -> float | None:
    """Bytes llama.cpp reads per main decode token, from the GGUF's own tensor sizes (None without gguf-py)."""
    if llama_src is not None:
        sys.path.insert(0, str(llama_src / "gguf-py"))
    try:
        from gguf import GGUFReader
    except ImportError:
        return None
    r = GGUFReader(str(path))
    tensors = [(t.name, int(t.n_elements), int(t.n_bytes)) for t in r.tensors]
    return plan.gguf_bytes_per_token(tensors, c.num_hidden_layers, c.num_experts_per_tok, c.n_routed_experts,
                                     c.hidden_size)  # fmt: skip


NO_REPACK = ("--no-repack",)


def llama_decode(runner: LlamaCppRunner, tokens: int, extra: tuple[str, ...] = ()) -> tuple[float, int]:
    """One llama-completion process: (ms per decode token by its own eval timer, its peak RSS in bytes)."""
    out, rss = llama_run(runner, tokens, extra=extra)
    return out.decode_seconds / out.decode_tokens * 1e3, rss


def llama_flags(runner: LlamaCppRunner) -> tuple[str, ...]:
    """() when llama.cpp runs the GGUF with its defaults; NO_REPACK when its default weight repack crashes on this CPU
    (on AMX CPUs llama.cpp repacks Q8_0 / Q4_0 / Q4_K for its AMX matmul, which segfaults on these GGUFs: the run
    then measures its plain CPU dot products, and the table says so). LlamaCppError when neither runs."""
    try:
        llama_run(runner, 2)
        return ()
    except LlamaCppError:
        llama_run(runner, 2, extra=NO_REPACK)
        return NO_REPACK


def llama_run(
    runner: LlamaCppRunner, tokens: int, prompt: str = PROMPT, extra: tuple[str, ...] = ()
) -> tuple[LlamaOutput, int]:
    """One llama-completion process (K=0, greedy): (its parsed statistics, its peak RSS in bytes). Reaped with wait4
    for its own rusage (output to temporary files, so nothing else waits on it; a timer kills a hung run)."""
    cmd = [*runner.command(prompt, 0, tokens), *extra]
    for _ in range(LOST_LOG_RETRIES + 1):
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            p = subprocess.Popen(cmd, stdout=out, stderr=err, env=runner.env)
            timer = threading.Timer(TIMEOUT_S, p.kill)
            timer.start()
            _, status, usage = os.wait4(p.pid, 0)
            timer.cancel()
            p.returncode = os.waitstatus_to_exitcode(status)  # reaped here: keep Popen from waiting on it again
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read().decode("utf-8", "replace"), err.read().decode("utf-8", "replace")
        if p.returncode != 0:
            last = (stderr.strip().splitlines() or ["(no output)"])[-1]
            raise LlamaCppError(f"llama-completion exited {p.returncode} (killed after {TIMEOUT_S}s if -9): {last}")
        try:
            return parse_completion(stdout, stderr), usage.ru_maxrss * 1024
        except LlamaCppError:
            continue  # llama.cpp's log lost its tail at exit (LlamaCppRunner.run_one): run again
    raise LlamaCppError("llama-completion's log lost its statistics lines on every try")


def phase(args: argparse.Namespace, threads: int, formats: list[plan.Format], ggufs: dict[str, Path]) -> dict:
    """One thread count: the interleaved rounds of every format, every llama.cpp quant and the bandwidth probe."""
    import torch

    torch.set_num_threads(threads)
    workers: dict[str, EngineWorker] = {}
    for f in formats:
        workers[f.name] = EngineWorker(args.build_dir / f.engine, args.build_dir / f.checkpoint, threads,
                                       args.context, args.ks)  # fmt: skip
        print(f"[{threads} thread(s)] {f.name}: loaded in {workers[f.name].load_s}s", flush=True)
    llama_rss: dict[str, int] = {}
    flags: dict[str, tuple[str, ...]] = {}
    jobs: dict[str, Callable[[], dict[str, float]]] = {
        f"ours {n}": partial(w.time, args.iters) for n, w in workers.items()
    }
    if args.llama_cpp:
        for q, path in ggufs.items():
            runner = LlamaCppRunner(args.llama_cpp, path, threads, 256)
            flags[q] = llama_flags(runner)

            def job(runner=runner, q=q) -> dict[str, float]:
                ms, rss = llama_decode(runner, args.llama_tokens, flags[q])
                llama_rss[q] = max(llama_rss.get(q, 0), rss)
                return {"decode": ms}

            jobs[f"llama.cpp {q}"] = job
    jobs["bandwidth"] = lambda: {"gb_s": measure_bandwidth() / 1e9}
    rounds: dict[str, list[dict[str, float]]] = {n: [] for n in jobs}
    names = list(jobs)
    for rnd in range(args.rounds):
        for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
            rounds[name].append(jobs[name]())
        print(f"[{threads} thread(s)] round {rnd + 1}/{args.rounds}: " + ", ".join(
            f"{n} {next(iter(v[-1].values())):.1f}" for n, v in rounds.items()), flush=True)  # fmt: skip
    rss = {n: w.stop() for n, w in workers.items()}
    print(f"[{threads} thread(s)] engine processes' memory: {rss}", flush=True)
    return {"threads": threads, "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "load_s": {n: w.load_s for n, w in workers.items()}, "rounds": rounds,
            "llama_flags": {q: list(f) for q, f in flags.items() if f},
            "median_ms": {n: plan.medians(v) for n, v in rounds.items() if n != "bandwidth"},
            "bandwidth_gb_s_best": round(max(r["gb_s"] for r in rounds["bandwidth"]), 3),
            "engine_rss_bytes": rss,
            "peak_rss_bytes": {**{f"ours {n}": v["peak_rss_bytes"] for n, v in rss.items()},
                               **{f"llama.cpp {q}": v for q, v in llama_rss.items()}}}  # fmt: skip


def summarize(res: dict[str, Any], c: ModelConfig, formats: list[plan.Format], accept: dict[int, float]) -> None:
    """Per phase and format: bound, ratios, sizes, step costs, MTP at the bench's depth and at depth 46."""
    for ph in res["phases"]:
        bw = ph["bandwidth_gb_s_best"] * 1e9
        rows = {}
        for f in formats:
            ms = ph["median_ms"].get(f"ours {f.name}", {})
            llama = ph["median_ms"].get(f"llama.cpp {f.llama_quant}", {}).get("decode")
            bound = plan.main_bytes(c, 1, f) / bw * 1e3
            gbytes = res["gguf"].get(f.llama_quant, {}).get("read_bytes_per_token")
            row = {"label": f.label, "decode_ms": ms.get("decode"), "bound_ms": round(bound, 3),
                   "over_bound": round(ms["decode"] / bound, 3) if "decode" in ms else None,
                   "llama_quant": f.llama_quant, "llama_ms": llama,
                   "llama_bound_ms": round(gbytes / bw * 1e3, 3) if gbytes else None,
                   "over_llama": round(ms["decode"] / llama, 3) if llama and "decode" in ms else None,
                   "engine_bytes": res["engines"][f.name]["bytes"],
                   "engine_aoti_bytes": res["engines"][f.name]["aoti_bytes"],
                   "rss_after_load_bytes": ph["engine_rss_bytes"].get(f.name, {}).get("rss_after_load_bytes"),
                   "gguf_bytes": res["gguf"].get(f.llama_quant, {}).get("bytes"),
                   "peak_rss_bytes": ph["peak_rss_bytes"].get(f"ours {f.name}"),
                   "llama_peak_rss_bytes": ph["peak_rss_bytes"].get(f"llama.cpp {f.llama_quant}"),
                   "steps_ms": ms,
                   "mtp_x_k0_bench_depth": plan.mtp_at_bench_depth(ms, accept) if "decode" in ms else {},
                   "mtp_projection_depth_46": plan.project_depth(ms, c, f, accept) if "decode" in ms else {}}  # fmt: skip
            rows[f.name] = row
        ph["formats"] = rows
        ph["llama_only"] = {}
        for q, g in res["gguf"].items():
            llama_ms = ph["median_ms"].get(f"llama.cpp {q}", {}).get("decode")
            read = g.get("read_bytes_per_token")
            ph["llama_only"][q] = {"ms": llama_ms, "bound_ms": round(read / bw * 1e3, 3) if read else None}


def run(args: argparse.Namespace) -> dict[str, Any]:
    formats = [plan.format_by_name(n) for n in args.formats]
    ckpt = args.build_dir / "air2"
    for f in formats:
        if not (args.build_dir / f.engine / "config.json").is_file():
            raise BenchSetupError(f"{args.build_dir / f.engine} missing: `make bench-realsize` builds it "
                                  f"(mtp-build {' '.join([*f.build_flags, '--compile', 'aoti'])})")  # fmt: skip
    c = ModelConfig.from_hf_dict(json.loads((ckpt / "config.json").read_text()))
    quants = list(plan.LLAMA_QUANTS)
    ggufs = ensure_ggufs(args.build_dir, args.llama_cpp, args.llama_src, quants) if args.llama_cpp else {}
    accept = deep_acceptance(args.acceptance_from, args.ks) if args.acceptance_from.is_file() else {}
    res: dict[str, Any] = {
        "command": " ".join(["python -m runtime.bench.realsize_formats", *sys.argv[1:]]),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpu": _cpu_name(), "cores": os.cpu_count(), "load_average_start": list(os.getloadavg()),
                    "note": "a shared machine: other jobs ran beside the bench; ratios within a phase are the point"},
        "model": {"checkpoint": str(ckpt), "checkpoint_bytes": plan.dir_bytes(ckpt / "model.safetensors"),
                  "shapes": "GLM-4.5-Air layer shapes; 2 main layers (1 dense + 1 MoE) + 1 MTP, 8 experts top-4, "
                            "vocab 2048 (runtime/bench/realsize_ckpt.py)"},
        "settings": {"threads": args.threads, "batch": 1, "context": args.context, "rounds": args.rounds,
                     "iters": args.iters, "llama_tokens": args.llama_tokens, "ks": args.ks,
                     "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                     "clock": "wall (perf_counter); llama.cpp: its own eval timer; medians over rounds"},
        "engines": {f.name: {"path": str(args.build_dir / f.engine), "bytes": plan.dir_bytes(args.build_dir / f.engine),
                             "aoti_bytes": plan.compiled_bytes(args.build_dir / f.engine),
                             "bytes_per_weight": f.bytes_per_weight, "build_flags": list(f.build_flags)}
                    for f in formats},
        "gguf": {q: {"path": str(p), "bytes": p.stat().st_size,
                     "read_bytes_per_token": gguf_read_bytes(p, args.llama_src, c)} for q, p in ggufs.items()},
        "mtp_acceptance_from_deep_model": {"source": f"{args.acceptance_from} (batch 1)", "length": accept},
        "projection_label": (f"PROJECTION to {plan.AIR_DEPTH} main layers (GLM-4.5-Air's depth) of the bench's layer "
                             "shapes: main forwards scaled by their weight bytes, draft and commit as measured, the deep "
                             "model's acceptance; not a measured MTP run"),
        "phases": [phase(args, t, formats, ggufs) for t in args.threads],
    }  # fmt: skip
    summarize(res, c, formats, accept)
    return res


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--build-dir", type=Path, default=BUILD_DIR, help="checkpoints, engines and GGUFs (make bench-realsize)"
    )
    p.add_argument("--formats", nargs="+", default=[f.name for f in plan.FORMATS])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--llama-cpp", type=Path, help="llama.cpp bin dir (llama-completion, llama-quantize)")
    p.add_argument("--llama-src", type=Path, help="llama.cpp source (convert_hf_to_gguf.py, gguf-py)")
    p.add_argument("--context", type=int, default=32, help="prompt tokens in the KV cache before the timed step")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--llama-tokens", type=int, default=16)
    p.add_argument("--acceptance-from", type=Path, default=Path("bench_results/bench.json"))
    p.add_argument("--output", type=Path, default=Path("bench_results/realsize.json"))
    p.add_argument("--docs", type=Path, default=Path("docs/BENCHMARKS.md"), help="its realsize table is regenerated")
    p.add_argument("--plot", type=Path, default=Path("bench_results/realsize.png"))
    args = p.parse_args(argv)
    try:
        res = run(args)
    except (BenchSetupError, LlamaCppError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.output.write_text(json.dumps(res, indent=2) + "\n")
    write_outputs(res, args.docs, args.plot)
    print(f"wrote {args.output}, {args.plot} and the table in {args.docs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
