"""Request and lifecycle rules of the Triton model, kept free of `triton_python_backend_utils` so they run
(and are tested) outside the stub. model.py is the only caller.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Prompts are refused above this many bytes per max_seq_len token, BEFORE tokenizing: tokenizing 10 MB took
# ~15 s of CPU. BPE text averages 3-5 bytes per token, so 8 leaves room; --max-prompt-bytes overrides it.
BYTES_PER_TOKEN_BOUND = 8
OUTCOMES = ("admitted", "finished", "cancelled", "failed", "rejected")


def prompt_byte_limit(max_seq_len: int, override: int | None = None) -> int:
    return override if override is not None else BYTES_PER_TOKEN_BOUND * max_seq_len


def prompt_size_error(num_bytes: int, limit: int) -> str | None:
    if num_bytes <= limit:
        return None
    return (f"text_input is {num_bytes} bytes; this server accepts at most {limit} "
            "(max_prompt_bytes): shorten the prompt, or start mtp-serve with a larger --max-prompt-bytes")  # fmt: skip


def top_p_off(top_p: float) -> float:
    """TensorRT-LLM clients send top_p=0 meaning "no nucleus filter"; the engine's "off" is 1.0."""
    return 1.0 if top_p == 0.0 else top_p


def cancelled(sender: Any) -> tuple[bool, str | None]:
    """(cancelled, why the check failed). A sender whose is_cancelled() raises is broken: the response can
    never be delivered, so the request is treated as cancelled (and aborted) rather than run for nobody."""
    try:
        return bool(sender.is_cancelled()), None
    except Exception as e:
        return True, f"is_cancelled() failed ({type(e).__name__}: {e}); aborting the request"


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of text. encode_batch releases the GIL (encode does not), so a long prompt tokenized in
    execute() does not stall the engine loop thread."""
    return list(tokenizer.encode_batch([text])[0].ids)


@dataclass
class Counts:
    """Request outcomes since the model loaded: admitted == finished + cancelled + failed once idle."""

    by_outcome: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))

    def add(self, outcome: str) -> None:
        self.by_outcome[outcome] += 1


@dataclass
class Control:
    """The control directory shared with mtp-serve (runtime/serving/process.py): `drain` in, `drained` out."""

    directory: Path | None

    @classmethod
    def from_env(cls) -> Control:
        d = os.environ.get("MTP_SERVE_CONTROL_DIR")
        return cls(Path(d) if d else None)

    def drain_timeout(self) -> float | None:
        """Seconds the in-flight streams may still run, once mtp-serve asked to drain; None otherwise."""
        if self.directory is None:
            return None
        try:
            return float(json.loads((self.directory / "drain").read_text())["timeout_s"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError):
            return 0.0  # a drain file we cannot read still means "stop": drain without grace

    def report_drained(self) -> None:
        if self.directory is not None:
            tmp = self.directory / "drained.tmp"
            tmp.write_text("1")
            tmp.replace(self.directory / "drained")
