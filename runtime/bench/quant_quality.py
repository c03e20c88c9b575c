"""What weight quantization costs in output and buys in speed: two engines of one checkpoint, side by side.

    python -m runtime.bench.quant_quality --checkpoint models/deep --engines ENGINE_FP32 ENGINE_INT8 \
        --num-prompts 8 --max-tokens 64 --rounds 3 --k 0 2

Greedy on held-out prompts (runners.make_workload, the bench's own workload). Quality, against the first engine:
the fraction of generated tokens equal to its tokens at the same position, and the tokens generated before the
first difference (greedy decoding diverges for good after one different token, so this is the stricter figure).
MTP: the mean acceptance length at each K (a quantized main model drafts against itself through the commit
pass; what changes is how well the float MTP head predicts the quantized main model). Perplexity: each engine's
teacher-forced perplexity on other held-out files (`perplexity`; --ppl-files, cut to the engine's token budget).
Speed: end-to-end
generated tokens/s per engine and K, medians of interleaved rounds (engine A, engine B, A, B, ...), 1 thread
unless --threads. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from runtime.bench.runners import heldout_files, make_workload
from runtime.core.sampling import SamplingParams
from runtime.executors.base import MainInput
from runtime.factory import create_engine


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    """Position-wise token agreement and the mean run of equal tokens before the first difference (pure)."""
    same = total = 0
    runs = []
    for a, b in zip(reference, other, strict=True):
        n = min(len(a), len(b))
        same += sum(x == y for x, y in zip(a[:n], b[:n], strict=True))
        total += max(len(a), len(b))
        run = next((i for i in range(n) if a[i] != b[i]), n)
        runs.append(run)
    return {"token_agreement": same / max(total, 1), "mean_tokens_before_first_difference": statistics.mean(runs)}


def perplexity(engine_dir: Path, texts: list[list[int]], threads: int = 1) -> float:
    """exp of the mean negative log-likelihood of every token after the first of each text given those before it
    (teacher forcing), each text cut to the engine's token budget and run as one prefill forward, every row's logits,
    on a fresh engine of its own (it writes the pool's blocks 1.. directly: no cached prefix may point at them)."""
    engine = create_engine(engine_dir, executor="compiled", threads=threads, num_draft_tokens=0)
    cfg = engine.cfg
    nll, count = 0.0, 0
    for text in texts:
        ids = text[: min(cfg.max_num_tokens, cfg.max_seq_len, (cfg.num_blocks - 1) * cfg.block_size)]
        n = len(ids)
        table = np.full((1, engine.width), -1, dtype=np.int32)
        table[0, : -(-n // cfg.block_size)] = np.arange(1, 1 - (-n // cfg.block_size), dtype=np.int32)
        rows = np.arange(n, dtype=np.int64)
        inp = MainInput(np.asarray(ids, dtype=np.int64), rows, np.array([n], np.int32), np.array([n], np.int32), table,
                        rows)  # fmt: skip
        logp = torch.log_softmax(torch.from_numpy(engine.executor.run_main(inp).logits[:-1]).double(), dim=-1)
        nll -= float(logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).sum())
        count += n - 1
    return math.exp(nll / max(count, 1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, required=True, help="the checkpoint the engines were built from")
    p.add_argument("--engines", type=Path, nargs=2, required=True, metavar=("REFERENCE", "OTHER"))
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-chars", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--k", type=int, nargs="+", default=[0, 2], help="K values (at most the engines' built K)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ppl-files", type=int, default=16, help="held-out files for the perplexity (0: none)")
    args = p.parse_args(argv)
    engines = {(str(e), k): create_engine(e, executor="compiled", threads=args.threads, num_draft_tokens=k)
               for e in args.engines for k in args.k}  # fmt: skip
    first = next(iter(engines.values()))
    work = make_workload(args.checkpoint, args.num_prompts, args.prompt_chars, first.model_cfg.vocab_size,
                         first.tokenizer)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)  # end_id None: every request runs its length
    seconds: dict[tuple[str, int], list[float]] = {}
    tokens: dict[tuple[str, int], list[list[int]]] = {}
    accept: dict[tuple[str, int], float] = {}
    for _ in range(args.rounds):
        for key, engine in engines.items():  # interleaved: every engine and K once per round
            t0 = time.perf_counter()
            outs = engine.generate(work.prompts, params)
            seconds.setdefault(key, []).append(time.perf_counter() - t0)
            tokens[key] = [list(o.output_ids) for o in outs]
            # tokens per verify step, the main model's own included (mtp-run's mean_acceptance_length)
            accept[key] = statistics.mean((sum(o.accepted_per_step) + o.num_steps) / max(o.num_steps, 1) for o in outs)
    ref, other = (str(e) for e in args.engines)
    ppl: dict[str, float] = {}
    if args.ppl_files and first.tokenizer is not None:  # a wider pick from the same held-out list
        files = heldout_files(args.checkpoint, args.num_prompts + args.ppl_files)[0][args.num_prompts :]
        texts = [list(first.tokenizer.encode(f.read_text(encoding="utf-8", errors="replace")).ids) for f in files]
        ppl = {Path(e).name: round(perplexity(e, texts, args.threads), 4) for e in args.engines}
    generated = sum(len(t) for t in tokens[(ref, args.k[0])])
    report = {
        "workload": {"files": work.sources, "heldout": work.heldout, "max_tokens": args.max_tokens},
        "quality_k0": agreement(tokens[(ref, args.k[0])], tokens[(other, args.k[0])]),
        "tokens_per_s": {f"{Path(n).name} K={k}": generated / statistics.median(s) for (n, k), s in seconds.items()},
        "acceptance_length": {f"{Path(n).name} K={k}": round(a, 3) for (n, k), a in accept.items() if k},
        "perplexity": ppl,
        "threads": args.threads,
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except ValueError as e:  # ConfigError and the loaders' errors: a bad path or option, in one line
        raise SystemExit(f"quant_quality: error: {e}") from None
