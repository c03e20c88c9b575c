"""Figures of hybrid prefix caching (docs/MODELS.md "Prefix caching"): time to first token of a request whose
2,000-token prefix was served before, against the first request's, the hit tokens, and what one state snapshot costs.

    PYTHONPATH=. python tests/runtime/hybrid_prefix_figures.py [--prefix 2000] [--k 2] [--interval N]

Torch executor on CPU, one thread, a random Qwen3-Next checkpoint (models/testing.py; `DEEP`: hidden 256, 6 GDN +
2 gated attention layers, 8 experts), block size 16, prefill chunks of 512, a state snapshot every `--interval` prompt
tokens (default: the runtime's; 0 = only each forward's last block boundary). Three requests run one after another:
A = prefix + tail 1, B = prefix + tail 2 (its hit is cut back to the last snapshot inside the prefix: A's last interval
or chunk boundary there), C = prefix + tail 3 (B snapshotted the branch point, the end of the prefix's shared blocks).
Then A again (the whole prompt repeated).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from models.testing import make_hybrid_checkpoint
from runtime.core.sampling import SamplingParams
from runtime.factory import create_engine
from tests.runtime.engine_utils import random_prompts

# wider and deeper than the tests' tiny checkpoint, so a prefill costs more than the step's host work
DEEP = dict(vocab_size=64, hidden_size=256, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
            head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=4,
            linear_num_value_heads=8, moe_intermediate_size=128, shared_expert_intermediate_size=256,
            max_position_embeddings=4096, layer_types=["linear_attention"] * 3 + ["full_attention"]
            + ["linear_attention"] * 3 + ["full_attention"])  # fmt: skip


def ttft(engine, prompt: list[int]) -> tuple[float, int]:
    """Seconds from add_request to the request's first output token, and the prompt tokens served from the cache."""
    t0 = time.perf_counter()
    req = engine.add_request(prompt, SamplingParams(max_tokens=2))
    while True:
        for out in engine.step():
            if out.req_id == req and out.output_ids:
                seconds = time.perf_counter() - t0
                for _ in engine.stream():  # finish it
                    pass
                return seconds, out.num_cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", type=int, default=2000)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--interval", type=int, default=None, help="state snapshot interval in tokens (default: runtime's)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = tempfile.mkdtemp()
    make_hybrid_checkpoint(path, "qwen3_next", seed=2, **DEEP)
    prefix = random_prompts((args.prefix,), vocab=64, seed=1)[0]
    tails = random_prompts((7, 9, 5), vocab=64, seed=2)
    engine = create_engine(checkpoint=path, executor="torch", num_draft_tokens=args.k, block_size=16, num_blocks=600,
                           max_batch=4, max_num_tokens=512, max_prefill_chunk=512, max_seq_len=args.prefix + 64,
                           state_snapshot_interval=args.interval)  # fmt: skip
    ttft(engine, random_prompts((64,), vocab=64, seed=3)[0])  # warm-up
    rows = []
    for name, prompt in (("A prefix+tail1", prefix + tails[0]), ("B prefix+tail2", prefix + tails[1]),
                         ("C prefix+tail3", prefix + tails[2]), ("A again", prefix + tails[0])):  # fmt: skip
        seconds, cached = ttft(engine, prompt)
        rows.append((name, len(prompt), seconds, cached))
    first = rows[0][2]
    print(f"{'request':16} {'prompt':>6} {'TTFT s':>8} {'vs A':>6} {'hit tokens':>10} {'of prefix':>9}")
    for name, n, s, c in rows:
        print(f"{name:16} {n:6d} {s:8.3f} {s / first:6.3f} {c:10d} {c / args.prefix:9.1%}")
    snaps = engine.state_slots.snapshots
    one = (engine.executor.state.conv[:, 0].nbytes + engine.executor.state.ssm[:, 0].nbytes)
    print(f"snapshot interval {engine.cfg.snapshot_interval} tokens; snapshot slots: {snaps.num_slots} (cached now "
          f"{snaps.num_cached}); one snapshot = {one} bytes here")  # fmt: skip
    # Qwen3-Next-80B-A3B: 36 GDN layers, Hk 16 x Dk 128, Hv 32 x Dv 128, conv kernel 4, bf16 conv window
    layers, conv_dim, ssm = 36, 2 * 16 * 128 + 32 * 128, 32 * 128 * 128 * 4
    print(f"Qwen3-Next-80B dims: one snapshot = {layers * (conv_dim * 3 * 2 + ssm) / 2**20:.1f} MiB")

if __name__ == "__main__":
    main()
