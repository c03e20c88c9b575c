"""The admission policy both serving frontends apply before a request reaches the engine loop.

Pure and frontend-neutral: bounds on the raw prompt (checked on the bytes, before decoding or tokenizing),
on the stop strings, and on the requests in flight. The engine's own checks (runtime/core/admission.py,
SamplingParams.validate) come after these; the sampling-parameter rules are the engine's alone, so both
frontends refuse the same values with the same line (top_p=0 is refused, as vLLM does: use 1.0 for "off").
"""

from __future__ import annotations

# Prompts are refused above this many bytes per max_seq_len token, BEFORE tokenizing: tokenizing 10 MB took
# ~15 s of CPU. BPE text averages 3-5 bytes per token, so 8 leaves room; --max-prompt-bytes overrides it.
BYTES_PER_TOKEN_BOUND = 8
# OpenAI's API accepts at most 4 stop sequences. Each is matched against the output text every step, so a
# bound on their number and length bounds that work: 7,000 stop strings doubled a request's own latency.
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256


def prompt_byte_limit(max_seq_len: int, override: int | None = None) -> int:
    return override if override is not None else BYTES_PER_TOKEN_BOUND * max_seq_len


def prompt_size_error(num_bytes: int, limit: int, field: str = "text_input") -> str | None:
    if num_bytes <= limit:
        return None
    return (f"{field} is {num_bytes} bytes; this server accepts at most {limit} "
            "(max_prompt_bytes): shorten the prompt, or start mtp-serve with a larger --max-prompt-bytes")  # fmt: skip


def default_max_queue(max_batch: int) -> int:
    """Requests in flight (queued + running) before a new one is refused: a few batches' worth."""
    return 4 * max_batch + 64


def stop_error(stops: tuple[str, ...] | list[str], field: str = "stop") -> str | None:
    """Why these stop strings are refused (None: accepted)."""
    if len(stops) > MAX_STOP_SEQUENCES:
        return f"{field} has {len(stops)} sequences; this server accepts at most {MAX_STOP_SEQUENCES}"
    longest = max((len(s) for s in stops), default=0)
    if longest > MAX_STOP_CHARS:
        return f"{field} has a sequence of {longest} characters; this server accepts at most {MAX_STOP_CHARS}"
    return None
