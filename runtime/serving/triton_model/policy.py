"""Request and lifecycle rules of the Triton model, kept free of `triton_python_backend_utils` so they run
(and are tested) outside the stub. model.py is the only caller.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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
