"""Stream-text stabilisation, shared by both frontends: which part of a growing output text may be sent now."""

from __future__ import annotations


def stable_text(text: str, stops: tuple[str, ...]) -> str:
    """The part of a growing text safe to stream: no half-decoded character at the end, and nothing that may
    still become the start of a stop string (the engine cuts the text there)."""
    text = text.rstrip("\ufffd")
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return text[: len(text) - hold]


class TextDelta:
    """What one stream has sent so far; `next` returns the new, stable part of the text (all of it once finished)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.sent = ""

    def next(self, text: str, finished: bool) -> str:
        text = text if finished else stable_text(text, self.stops)
        if not text.startswith(self.sent):  # the engine cut a stop string the stream had not sent: send nothing
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta
