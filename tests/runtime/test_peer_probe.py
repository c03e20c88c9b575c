"""runtime/multirank/peer_probe.py: what a firing watchdog learns from the other ranks, on real sockets in one
process: a rank that answers "not in MPI" is named with its step and wait, one inside MPI is not, a closed port
is a process that is gone, an unreachable address is a host or link that is down."""

from __future__ import annotations

import socket

import pytest

from runtime.multirank.peer_probe import IN_MPI, NOT_IN_MPI, Contact, PeerProbe, blame, local_addresses


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_blame_names_the_ranks_not_in_the_collective():
    here = socket.gethostname()
    busy = PeerProbe(1, lambda: f"{NOT_IN_MPI}: step 3, main forward, armed 10.2 s ago").contact()
    waiting = PeerProbe(2, lambda: f"{IN_MPI}: step 3, main forward, armed 10.1 s ago").contact()
    me = Contact(0, here, ("127.0.0.1",), 1)
    assert busy.addresses == local_addresses() and busy.addresses[-1].startswith("127.")
    assert blame([me, busy, waiting], 0) == "rank 1 is not in a collective: step 3, main forward, armed 10.2 s ago"
    assert blame([me, waiting], 0) is None  # everyone else is inside MPI too: nothing to name
    gone = Contact(3, here, ("127.0.0.1",), _closed_port())
    assert blame([me, gone, waiting], 0) == "rank 3 is gone: nothing listens on its port, its process died"


def test_a_peer_that_never_answers_is_silent_and_its_loopback_is_not_tried():
    """A peer whose connection opens but never answers (what a host with its link down looks like to a waiting rank:
    no line within ANSWER_TIMEOUT_S) "does not answer"; its 127.0.0.1 is not tried from another host (it would be
    this host's own loopback: here a live probe that would answer)."""
    outside = [a for a in local_addresses() if not a.startswith("127.")]
    if not outside:
        pytest.skip("no non-loopback IPv4 address on this machine")
    me = Contact(0, "host-a", ("127.0.0.1",), 1)
    mute = socket.socket()
    mute.bind((outside[0], 0))
    mute.listen(1)  # the kernel completes the connection; nobody ever writes
    try:
        live = PeerProbe(1, lambda: f"{NOT_IN_MPI}: step 1, no wait armed").contact()
        far = Contact(1, "host-b", (outside[0], "127.0.0.1"), mute.getsockname()[1])
        assert live.port != far.port
        assert blame([me, far], 0) == "rank 1 on host-b does not answer: its host or the link is down"
        far_live = Contact(1, "host-b", ("127.0.0.1",), live.port)  # only a loopback address: never tried
        assert blame([me, far_live], 0) == "rank 1 on host-b does not answer: its host or the link is down"
    finally:
        mute.close()
