"""Run one rank's load + export (+ its AOTInductor compile) in a child process, so that rank's weights leave
memory with it.

Why: torch.onnx's exporter keeps references to the weights of the graphs it exported (its IR wraps the torch
tensors), so in one process every exported rank's share stayed resident until the build ended (measured on an
848 MiB EP4 checkpoint: peak 1.6 GiB, about the whole fp32 model, instead of one rank's share). A child per
rank bounds a multi-rank build's peak RSS by one rank's share plus the exporter's own work
(docs/CHECKPOINTS.md has the figures).

The child is spawned (not forked: a forked OpenMP runtime can deadlock the child) and reports its progress
lines, its result or its exception over a pipe; the parent shows the progress on its own reporter. If the
parent is interrupted (BuildInterrupted) or the child dies, the child is killed and the build fails as usual,
with its temporary directory removed by the caller.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from builder.options import BuildError

T = TypeVar("T")
EXIT_GRACE_S = 60.0  # how long a child that reported its result may take to exit before it is killed


class _PipeReporter:
    """The child's Reporter: forwards each progress line to the parent."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def step(self, name: str) -> None:
        self.conn.send(("step", name))

    def done(self, what: str, seconds: float) -> None:
        self.conn.send(("done", what, seconds))

    def track(self, items: Sequence[str], what: str) -> Iterator[str]:
        """A rank's progress in lines (a bar per child would interleave): each item as it starts and ends."""
        for i, item in enumerate(items, 1):
            self.step(f"{what} {i}/{len(items)}: {item}")
            t0 = time.perf_counter()
            yield item
            self.done(f"{what} of {item}", time.perf_counter() - t0)


def _child(conn, fn: Callable[..., Any], args: tuple) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent handles it
    try:
        conn.send(("ok", fn(*args, _PipeReporter(conn))))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent, which raises it
        try:
            conn.send(("error", e))
        except Exception:  # an exception that does not pickle: its text is enough
            conn.send(("error", BuildError(f"{type(e).__name__}: {e}")))
    finally:
        conn.close()


def run_in_child(fn: Callable[..., T], args: tuple, rep, what: str) -> T:
    """fn(*args, reporter) in a spawned child; its progress goes to `rep`, its exception is re-raised here."""
    ctx = mp.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(sender, fn, args), daemon=True)
    proc.start()
    sender.close()
    reported = False  # the child sent its result or its error: it is exiting on its own
    try:
        while True:
            try:
                msg = receiver.recv()
            except EOFError:
                proc.join()
                raise BuildError(f"{what} died with exit code {proc.exitcode} (killed for memory?); rerun with "
                                 "fewer ranks per build machine or more memory") from None  # fmt: skip
            if msg[0] == "step":
                rep.step(msg[1])
            elif msg[0] == "done":
                rep.done(msg[1], msg[2])
            else:
                reported = True
                if msg[0] == "ok":
                    return msg[1]
                raise msg[1]
    finally:
        # A child that reported is let finish: killed while it exits, it leaves the semaphores its libraries made
        # to the resource tracker, which then warns of "leaked semaphore objects" after every multi-rank build.
        proc.join(timeout=EXIT_GRACE_S if reported else 0)
        if proc.is_alive():
            proc.kill()
        proc.join()
        receiver.close()
