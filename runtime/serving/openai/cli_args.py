"""The `mtp-serve` flags only the OpenAI frontend reads (kept here so triton_server.py's CLI stays small)."""

from __future__ import annotations

import argparse

from runtime.core.acceptance_guard import CHECK_MODES, DEFAULT_CHECK_MODE


def add_openai_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--frontend openai")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    g.add_argument("--port", type=int, default=8000, help="HTTP port of the OpenAI API")
    g.add_argument("--max-queue", type=int, default=None,
                   help="requests in flight (queued + running) before 429 / a refusal, both frontends "
                        "(default: 4 x max_batch + 64)")
    g.add_argument("--served-model-name", default=None, help="model id in /v1/models (default: the directory name)")
    g.add_argument("--read-timeout", type=float, default=30.0,
                   help="seconds a client may take to send its whole request before the connection is closed")
    g.add_argument("--grammar-cache-mb", type=int, default=512, metavar="MB",
                   help="memory for compiled grammars (structured output), least recently used evicted first "
                        "(default 512, as vLLM)")
    g.add_argument("--grammar-max-bytes", type=int, default=32 << 10, metavar="BYTES",
                   help="largest output constraint (JSON schema, regex, EBNF) accepted; larger is a 400 (default 32768)")
    g.add_argument("--grammar-compile-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="a grammar compile's time limit, queueing included: past it the request is refused (default 10)")
    g.add_argument("--acceptance-check", choices=CHECK_MODES, default=DEFAULT_CHECK_MODE,
                   help="start-up self-check of MTP acceptance on built-in prompts (single process): warn (one "
                        "line when implausibly low), strict (exit instead), off (skip; saves ~1 s on models/deep)")
    g.add_argument("--per-request-spec-decode-metrics", choices=("off", "summary", "detailed"), default="off",
                   help="add per-request speculative-decoding stats to every response, as vLLM's flag of the same "
                        "name: a top-level metrics.speculative_decoding object (default: off, responses unchanged)")
