"""mtp-bench serve: latency percentiles of a real server under load (Poisson arrivals or fixed concurrency).

    python -m runtime.bench.serve_bench --checkpoint models/deep --executor torch \
        --frontend openai,triton,inprocess --num-draft-tokens 0,3,auto --rates 0.5,1,2 --max-concurrency 4

For each (frontend, K) it starts the server (`mtp-serve --frontend openai|triton`) on loopback, sends a fixed
prompt set (held-out stdlib files cut to varied lengths, greedy, --max-tokens each) at each Poisson request
rate and in the closed-loop max-concurrency mode, measures per request TTFT, TPOT, ITL and end-to-end
latency from the client side, and stops it. `inprocess` drives the same engine loop the OpenAI frontend uses
without HTTP: the baseline for frontend overhead. `--openai-url URL` adds an already-running OpenAI server
(e.g. llama.cpp's llama-server) at the same rates. A K the server refuses (e.g. `auto` before the engine
supports it) is skipped with a note. Output: <output-dir>/serve_bench.json, serve_table.md, PNG plots.

Definitions (as vLLM's benchmark_serving): TTFT = request sent -> first content chunk; ITL = gap between
consecutive content chunks (an MTP step may carry several tokens in one chunk); TPOT = (latency - TTFT) /
(output tokens - 1).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from runtime.bench.runners import heldout_files
from runtime.bench.serve_report import summarize, write_outputs
from runtime.core.draft_length import parse_num_draft_tokens
from runtime.serving.process import free_ports

FRONTENDS = ("openai", "triton", "inprocess")
PROMPT_TOKENS = (48, 160, 384)  # varied prompt lengths (tokens), cycled over the prompt files


@dataclass(slots=True)
class RequestResult:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    num_output: int = 0
    num_prompt_chars: int = 0
    error: str = ""
    _t0: float = field(default_factory=time.perf_counter)  # when the request was sent
    _last: float = 0.0  # when the previous token-carrying event arrived

    def tokens_arrived(self) -> None:
        """A response carrying tokens arrived now: the first sets TTFT, later ones add an inter-token latency."""
        now = time.perf_counter()
        if self.ttft == 0.0:
            self.ttft = now - self._t0
        else:
            self.itls.append(now - self._last)
        self._last = now

    def done(self, ok: bool) -> RequestResult:
        self.latency, self.ok = time.perf_counter() - self._t0, ok
        return self


def prompt_set(source: Path, n: int) -> list[str]:
    """n prompts from the held-out stdlib files, prompt i cut at a character boundary to PROMPT_TOKENS[i % 3] tokens
    (the source's tokenizer), so the lengths vary but every prompt + --max-tokens fits the default max_seq_len of 512.
    More prompts than files (32 streams need 32 prompts in flight) cycle the files, each pass cut one length further
    on, so no two prompts are the same text."""
    from runtime.factory import load_tokenizer

    pool, _ = heldout_files(source, None)
    files = heldout_files(source, n)[0] if n <= len(pool) else [pool[i % len(pool)] for i in range(n)]
    tok = load_tokenizer(source)
    out = []
    for i, f in enumerate(files):
        cut = PROMPT_TOKENS[(i + i // len(pool)) % len(PROMPT_TOKENS)]
        text, limit = f.read_text(encoding="utf-8", errors="replace")[:8000], cut
        if tok is None:
            out.append(text[:limit])
            continue
        enc = tok.encode(text)
        out.append(text[: enc.offsets[min(limit, len(enc.ids)) - 1][1]])
    return out


# ---------------------------------------------------------------------- clients (one request each)
async def _sse_lines(resp):
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data:"):
            yield line[5:].strip()


async def _stream(session, url: str, body: dict, tokens_in) -> RequestResult:
    """POST one streaming request and time it: TTFT at the first event carrying tokens, ITL between such
    events. tokens_in(event) -> (tokens in it, or None when the event says the stream is done)."""
    res = RequestResult(False, num_prompt_chars=len(body.get("prompt") or body.get("text_input") or ""))
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for data in _sse_lines(resp):
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"])
                    return res
                if tokens_in(obj, res):
                    res.tokens_arrived()
    except Exception as e:  # noqa: BLE001 - a failed request is counted in the results, not fatal
        res.error = f"{type(e).__name__}: {e}"
        return res
    return res.done(res.ttft > 0)


def _openai_tokens(obj: dict, res: RequestResult) -> int:
    if obj.get("usage"):  # the final usage chunk (stream_options.include_usage) has the exact count
        res.num_output = int(obj["usage"]["completion_tokens"])
    return 1 if obj.get("choices") and obj["choices"][0].get("text") else 0


def _triton_tokens(obj: dict, res: RequestResult) -> int:
    ids = obj.get("output_ids")
    n = 1 if isinstance(ids, int) else len(ids or [])  # Triton's JSON drops the list for one id
    res.num_output += n
    return n


async def openai_request(session, url: str, model: str, prompt: str, max_tokens: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    return await _stream(session, url + "/v1/completions", body, _openai_tokens)


async def triton_request(session, url: str, prompt: str, max_tokens: int) -> RequestResult:
    body = {"text_input": prompt, "max_tokens": max_tokens, "stream": True}
    return await _stream(session, url + "/v2/models/mtp/generate_stream", body, _triton_tokens)


class InProcess:
    """The OpenAI frontend's engine loop, driven directly (no HTTP): the frontend-overhead baseline."""

    def __init__(self, args, k: str) -> None:
        from runtime.factory import create_engine
        from runtime.serving.openai.engine_loop import AsyncEngineLoop

        self.engine = create_engine(engine_dir=args.engine, checkpoint=args.checkpoint, executor=args.executor,
                                    num_draft_tokens=parse_num_draft_tokens(k), max_batch=args.max_batch)  # fmt: skip
        self.loop = AsyncEngineLoop(self.engine, max_queue=10**6)
        self.loop.start()

    async def request(self, prompt: str, max_tokens: int) -> RequestResult:
        from runtime.core.sampling import SamplingParams

        res = RequestResult(False, num_prompt_chars=len(prompt))
        ids = await asyncio.to_thread(lambda: list(self.engine.tokenizer.encode_batch([prompt])[0].ids))
        _, queue = self.loop.submit(ids, SamplingParams(max_tokens=max_tokens))
        while True:
            ev = await queue.get()
            if ev.error:
                res.error = ev.error
                return res
            if ev.new_token_ids:
                res.tokens_arrived()
                res.num_output += len(ev.new_token_ids)
            if ev.finished:
                break
        res.done(True)
        return res

    def close(self) -> None:
        self.loop.drain(5.0)


# ---------------------------------------------------------------------- load generation
async def run_load(send, prompts: list[str], rate: float | None, concurrency: int | None, seed: int = 0):
    """Poisson arrivals at `rate` req/s (open loop), or `concurrency` clients back to back (closed loop)."""
    t0 = time.perf_counter()
    if rate is not None:
        gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(prompts))
        tasks = []
        for prompt, gap in zip(prompts, gaps, strict=True):
            tasks.append(asyncio.create_task(send(prompt)))
            await asyncio.sleep(float(gap))
        results = await asyncio.gather(*tasks)
    else:
        todo = list(enumerate(prompts))
        out: dict[int, RequestResult] = {}

        async def worker() -> None:
            while todo:
                i, p = todo.pop(0)
                out[i] = await send(p)

        await asyncio.gather(*(worker() for _ in range(concurrency or 1)))
        results = [out[i] for i in range(len(prompts))]
    return list(results), time.perf_counter() - t0


# ---------------------------------------------------------------------- servers
_LIVE: set[Server] = set()  # servers to stop if the benchmark itself is stopped


def _stop_live() -> None:
    for server in list(_LIVE):
        server.close()


class Server:
    def __init__(self, args, frontend: str, k: str, workdir: Path) -> None:
        self.frontend, self.k = frontend, k
        src = ["--engine", str(args.engine)] if args.engine else ["--checkpoint", str(args.checkpoint)]
        cmd = [sys.executable, "-m", "runtime.serving.triton_server", "--frontend", frontend, *src,
               "--executor", args.executor, "--num-draft-tokens", k, "--threads", str(args.threads)]
        if args.max_batch:
            cmd += ["--max-batch", str(args.max_batch)]
        if frontend == "openai":
            port = free_ports(1)[0]
            cmd += ["--port", str(port), "--max-queue", "100000"]
            self.url, health = f"http://127.0.0.1:{port}", "/health"
        else:
            http, grpc, metrics = free_ports(3)
            cmd += ["--model-repo", str(workdir / f"repo-k{k}"), "--http-port", str(http), "--grpc-port", str(grpc),
                    "--metrics-port", str(metrics)]  # fmt: skip
            self.url, health = f"http://127.0.0.1:{http}", "/v2/models/mtp/ready"
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        self.log = workdir / f"{frontend}-k{k}.log"
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)  # fmt: skip
        _LIVE.add(self)
        deadline = time.monotonic() + args.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited {self.proc.returncode}: {self.log.read_text().strip().splitlines()[-1]}")
            try:
                with urllib.request.urlopen(self.url + health, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        self.close()
        raise RuntimeError(f"not ready within {args.ready_timeout:g} s")

    def close(self) -> None:
        _LIVE.discard(self)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


async def bench_target(send, prompts: list[str], args) -> list[dict]:
    rows = []
    for p in prompts[: len(PROMPT_TOKENS)]:  # warm-up, one prompt of each length (first-shape costs), not measured
        await send(p)
    loads = [(r, None) for r in args.rates] + [(None, c) for c in args.max_concurrency]
    for rate, conc in loads:
        results, wall = await run_load(send, prompts, rate, conc)
        rows.append({"mode": "poisson" if rate is not None else "concurrency", "rate": rate, "concurrency": conc,
                     **summarize(results, wall)})  # fmt: skip
        label = f"rate {rate:g}/s" if rate is not None else f"concurrency {conc}"
        s = rows[-1]
        print(f"  {label:>16}: {s['completed']}/{s['num_requests']} ok, TTFT p50 {s['ttft_ms']['p50']:.0f} ms, "
              f"TPOT p50 {s['tpot_ms']['p50']:.1f} ms, {s['output_throughput']:.1f} tok/s", flush=True)  # fmt: skip
    return rows


async def _bench_one(args, frontend: str, k: str, prompts: list[str], workdir: Path) -> dict:
    import aiohttp

    entry: dict = {"frontend": frontend, "num_draft_tokens": k}
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        if frontend == "inprocess":
            target = InProcess(args, k)
            try:
                entry["runs"] = await bench_target(lambda p: target.request(p, args.max_tokens), prompts, args)
            finally:
                target.close()
        elif frontend == "external":
            url = args.openai_url.rstrip("/")
            entry["url"] = url
            entry["runs"] = await bench_target(lambda p: openai_request(session, url, args.openai_model, p,
                                                                        args.max_tokens), prompts, args)  # fmt: skip
        else:
            server = await asyncio.to_thread(Server, args, frontend, k, workdir)
            try:
                if frontend == "openai":
                    send = lambda p: openai_request(session, server.url, "mtp", p, args.max_tokens)  # noqa: E731
                else:
                    send = lambda p: triton_request(session, server.url, p, args.max_tokens)  # noqa: E731
                entry["runs"] = await bench_target(send, prompts, args)
            finally:
                await asyncio.to_thread(server.close)
    return entry


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mtp-bench serve", description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--engine", type=Path)
    src.add_argument("--checkpoint", type=Path)
    p.add_argument("--executor", default=None, help="default: auto with --engine (compiled if built), else torch")
    p.add_argument("--frontend", default="openai,triton,inprocess", help=f"comma list of {', '.join(FRONTENDS)}")
    p.add_argument("--num-draft-tokens", default="0,3,auto", help="comma list of K (auto: the engine's choice)")
    p.add_argument("--rates", default="0.5,1,2", help="Poisson request rates (req/s), comma list")
    p.add_argument("--max-concurrency", default="4", help="closed-loop client counts, comma list ('' = none)")
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=None)
    p.add_argument("--threads", type=int, default=1, help="torch / OMP threads of the server")
    p.add_argument("--openai-url", default=None, help="also drive this OpenAI server (e.g. llama-server)")
    p.add_argument("--openai-model", default="default")
    p.add_argument("--ready-timeout", type=float, default=180.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--output-dir", type=Path, default=Path("bench_results/serve"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    atexit.register(_stop_live)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run atexit: no server outlives the benchmark
    args.executor = args.executor or ("auto" if args.engine else "torch")
    frontends = [f for f in args.frontend.split(",") if f]
    bad = [f for f in frontends if f not in FRONTENDS]
    if bad:
        print(f"mtp-bench serve: error: unknown frontend {bad[0]!r}; choose from {', '.join(FRONTENDS)}", file=sys.stderr)
        return 2
    try:
        args.rates = [float(r) for r in args.rates.split(",") if r]
        args.max_concurrency = [int(c) for c in args.max_concurrency.split(",") if c]
    except ValueError as e:
        print(f"mtp-bench serve: error: --rates / --max-concurrency: {e}", file=sys.stderr)
        return 2
    if any(r <= 0 for r in args.rates) or any(c < 1 for c in args.max_concurrency):
        print("mtp-bench serve: error: rates must be > 0 and concurrencies >= 1", file=sys.stderr)
        return 2
    ks = [k for k in args.num_draft_tokens.split(",") if k]
    prompts = prompt_set(Path(args.checkpoint or args.engine), args.num_prompts)
    targets = [(f, k) for f in frontends for k in ks] + ([("external", "-")] if args.openai_url else [])
    entries, notes = [], []
    with tempfile.TemporaryDirectory(prefix="mtp-serve-bench-") as tmp:
        for frontend, k in targets:
            print(f"{frontend} K={k}:", flush=True)
            try:
                entries.append(asyncio.run(_bench_one(args, frontend, k, prompts, Path(tmp))))
            except (RuntimeError, ValueError, TypeError) as e:  # e.g. an engine without K=auto
                notes.append(f"{frontend} K={k}: skipped: {e}")
                print(f"  {notes[-1]}", flush=True)
    meta = {"command": " ".join(sys.argv), "num_prompts": len(prompts), "prompt_tokens": list(PROMPT_TOKENS),
            "max_tokens": args.max_tokens, "threads": args.threads, "source": str(args.checkpoint or args.engine),
            "executor": args.executor, "cpu_count": os.cpu_count(), "notes": notes}  # fmt: skip
    paths = write_outputs(args.output_dir, meta, entries)
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


__all__ = ["RequestResult", "asdict", "main", "run_load"]

if __name__ == "__main__":
    sys.exit(main())
