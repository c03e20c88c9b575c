"""Which rank is to blame when a collective times out: the watchdog asks the others before it leaves.

A rank blocked in a collective cannot tell from MPI which peer is missing. So every rank of a multi-rank job
answers one line on a TCP port of its own (a daemon thread; the ports and addresses are exchanged at start-up,
`exchange_contacts`): whether it is inside an MPI call, its step, the wait the watchdog has armed and for how long.
When the watchdog fires, the rank asks every other rank at once (ANSWER_TIMEOUT_S each) and names those that are
not in the collective with it:

    rank 1 on B does not answer: its host or the link is down
    rank 1 is gone: nothing listens on its port, its process died
    rank 1 is not in a collective: step 3, main forward, armed 10.2 s ago

The answer runs on its own thread, so a rank stalled in compute (or in a sleep) still answers; a rank whose
process is gone or whose host is unreachable cannot, and that is the answer. Asking takes at most about
ANSWER_TIMEOUT_S, inside the watchdog's bounded last words.
"""

from __future__ import annotations

import contextlib
import fcntl
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

ANSWER_TIMEOUT_S = 1.0
_SIOCGIFADDR = 0x8915
IN_MPI, NOT_IN_MPI = "in MPI", "not in MPI"  # the first words of an answer


@dataclass(frozen=True)
class Contact:
    rank: int
    host: str
    addresses: tuple[str, ...]  # this host's IPv4 addresses, loopback last
    port: int


def local_addresses() -> tuple[str, ...]:
    """IPv4 address of every interface that has one (SIOCGIFADDR), loopback last."""
    found: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                found.append(socket.inet_ntoa(raw[20:24]))
    return tuple(sorted(set(found), key=lambda a: (a.startswith("127."), a)))


class PeerProbe:
    """This rank's answering thread: each connection gets `status()` as one line."""

    def __init__(self, rank: int, status: Callable[[], str]) -> None:
        self.rank, self.status = rank, status
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("0.0.0.0", 0))
        self._sock.listen(64)
        threading.Thread(target=self._serve, name="mtp-peer-probe", daemon=True).start()

    def contact(self) -> Contact:
        return Contact(self.rank, socket.gethostname(), local_addresses(), self._sock.getsockname()[1])

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn, contextlib.suppress(Exception):
                conn.sendall((self.status() + "\n").encode())


def ask(contact: Contact, from_host: str, timeout_s: float = ANSWER_TIMEOUT_S) -> str:
    """The peer's answer line, or "refused" (nothing listens: its process is gone) or "silent" (no answer)."""
    addresses = [a for a in contact.addresses if not a.startswith("127.") or contact.host == from_host]
    refused = False
    for address in addresses:
        try:
            with socket.create_connection((address, contact.port), timeout=timeout_s) as conn:
                conn.settimeout(timeout_s)
                line = conn.makefile("r").readline().strip()
                if line:
                    return line
        except ConnectionRefusedError:
            refused = True
        except OSError:
            pass
    return "refused" if refused else "silent"


def blame(contacts: list[Contact], me: int) -> str | None:
    """The peers that are not in the collective with this rank, as the watchdog's parenthesis; None when every
    other rank says it is inside MPI too (then the culprit is not among those asked)."""
    here = next((c.host for c in contacts if c.rank == me), socket.gethostname())
    others = [c for c in contacts if c.rank != me]
    answers: dict[int, str] = {}

    def one(c: Contact) -> None:
        answers[c.rank] = ask(c, here)

    threads = [threading.Thread(target=one, args=(c,), daemon=True) for c in others]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3 * ANSWER_TIMEOUT_S)
    spans = len({c.host for c in contacts}) > 1
    said = []
    for c in others:
        who = f"rank {c.rank} on {c.host}" if spans else f"rank {c.rank}"
        answer = answers.get(c.rank, "silent")
        if answer == "silent":
            said.append(f"{who} does not answer: its host or the link is down")
        elif answer == "refused":
            said.append(f"{who} is gone: nothing listens on its port, its process died")
        elif answer.startswith(NOT_IN_MPI):
            said.append(f"{who} is not in a collective: {answer.removeprefix(NOT_IN_MPI).lstrip(':; ')}")
    return "; ".join(said) or None


def exchange_contacts(comm, probe: PeerProbe) -> list[Contact]:
    """Every rank's contact, gathered over `comm` (a start-up collective: call it under the start-up guard)."""
    return list(comm.allgather(probe.contact()))
