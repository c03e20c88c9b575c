"""CUDA-graph capture for the torch executor on a GPU (invariant 10: captured execution).

Two captured families, each bucketed by request count R (powers of two up to max_batch):
  * draft depth:        forward_draft over R rows (one row per request)
  * decode-only verify: forward_main over R*(1+k) rows, every request a decode row of 1+k tokens
Prefill / mixed steps run eagerly. Every per-step tensor lives in a preallocated buffer with a stable
address; a step copies its inputs into the first rows and pads the rest as no-ops (count 0, block
table -1), replays the smallest bucket >= R and reads back the first rows. Capture happens only after
a warm run on a side stream, and a bucket whose capture fails (e.g. an op that syncs with the host,
such as the grouped MoE's nonzero) falls back to eager execution for good.

`mode="eager"` keeps the static buffers, bucketing and padding but re-executes the forward instead of
replaying a graph: it runs on CPU, and tests/runtime/test_padded_rows.py uses it to check everything
around the capture (buffer refills, padding, bucket choice, output slicing) against the plain executor.

NOTE: `mode="cuda"` needs a CUDA device and has not been executed on our CPU-only machines; the GPU
check script (`make gpu-check`) is where it gets exercised when a GPU is lent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


def buckets(max_batch: int) -> list[int]:
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


class GraphedFunction:
    """Replays `fn(*static_inputs)` captured per bucket; inputs are padded copies into static buffers.

    Args:
        fn: the forward to capture; takes the static input tensors (first `rows(bucket)` rows each).
        static: preallocated input buffers sized for the largest bucket, with their padding values.
        rows: number of leading rows each input has for a bucket (R for draft, R*(1+k) for verify tokens).
    """

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]], static: dict[str, tuple[torch.Tensor, int]],
                 rows: Callable[[str, int], int], max_batch: int, mode: str = "cuda") -> None:  # fmt: skip
        if mode not in ("cuda", "eager"):
            raise ValueError(f"mode={mode!r}: use 'cuda' (capture and replay) or 'eager' (static buffers only)")
        self.fn, self.static, self.rows, self.mode = fn, static, rows, mode
        self.buckets = buckets(max_batch)
        # bucket -> replay() returning the outputs, or None when capture failed (the caller runs eagerly)
        self.graphs: dict[int, Callable[[], tuple[torch.Tensor, ...]] | None] = {}

    def _views(self, bucket: int) -> list[torch.Tensor]:
        return [buf[: self.rows(name, bucket)] for name, (buf, _) in self.static.items()]

    def _capture(self, bucket: int) -> None:
        views = self._views(bucket)
        if self.mode == "eager":
            self.graphs[bucket] = lambda: self.fn(*views)
            return
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.fn(*views)  # warm run: kernels compiled, allocator settled
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outputs = self.fn(*views)

            def replay() -> tuple[torch.Tensor, ...]:
                graph.replay()
                return outputs

            self.graphs[bucket] = replay
        except RuntimeError as e:  # capture-hostile op: stay eager for this bucket
            log.warning("CUDA graph capture failed for bucket %d (%s); running eagerly", bucket, e)
            self.graphs[bucket] = None

    def __call__(self, num_requests: int, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...] | None:
        """Returns outputs for the first rows, or None when the caller must run eagerly."""
        bucket = next((b for b in self.buckets if b >= num_requests), None)
        if bucket is None:
            return None
        if bucket not in self.graphs:
            self._capture(bucket)
        entry = self.graphs[bucket]
        if entry is None:
            return None
        for name, (buf, pad) in self.static.items():
            n, total = inputs[name].shape[0], self.rows(name, bucket)
            buf[:n].copy_(inputs[name], non_blocking=True)
            buf[n:total].fill_(pad)
        return entry()
