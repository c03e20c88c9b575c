"""A build's signals (SIGTERM, SIGINT, SIGHUP): turned into `BuildInterrupted` while a build runs, so its temporary
directory is removed (builder/pipeline.py), and held over the steps that must not stop half-way."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


class BuildInterrupted(BaseException):
    """SIGTERM/SIGINT/SIGHUP during a build (a BaseException, so `except Exception` in export code lets it pass)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"build interrupted by {signal.Signals(signum).name}")


_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# The signals this build received. The handler's exception may surface wrapped (raised inside a library that turns
# it into its own error, which the export then reports as a BuildError): the signal, not the wrapper, is the cause.
_received: list[int] = []


def interrupted_by() -> int | None:
    """The first signal that interrupted the last build, if one did."""
    return _received[0] if _received else None


@contextlib.contextmanager
def raising() -> Iterator[None]:
    """Turn the signals that end a build into an exception, so its temporary directory is removed."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        _received.append(signum)
        raise BuildInterrupted(signum)

    _received.clear()
    old = {s: signal.signal(s, handler) for s in _SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Defer those signals over a step that must not stop half-way (install, cleanup)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)
