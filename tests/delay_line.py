"""A delay line between two network interfaces: every frame that arrives on one is sent out of the other DELAY
seconds later (both directions), in userspace over AF_PACKET sockets. What `tc qdisc ... netem delay` does, for
kernels without sch_netem (tests/multihost.py delayed_link). Usage: python -m tests.delay_line IFACE_A IFACE_B DELAY_S;
prints "ready" once both sockets are bound, runs until SIGTERM."""

from __future__ import annotations

import contextlib
import heapq
import select
import signal
import socket
import sys
import time

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15  # frames carry a virtio_net_hdr: large (GSO) frames cross whole, the kernel segments them
PACKET_OUTGOING = 4


def open_port(iface: str) -> socket.socket:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    sock.bind((iface, 0))
    sock.setblocking(False)
    return sock


def run(iface_a: str, iface_b: str, delay_s: float) -> None:
    a, b = open_port(iface_a), open_port(iface_b)
    other = {a: b, b: a}
    due: list[tuple[float, int, socket.socket, bytes]] = []
    seq = 0
    print("ready", flush=True)
    while True:
        wait = max(0.0, due[0][0] - time.monotonic()) if due else None
        readable, _, _ = select.select([a, b], [], [], wait)
        now = time.monotonic()
        for sock in readable:
            while True:
                try:
                    frame, addr = sock.recvfrom(1 << 17)
                except BlockingIOError:
                    break
                if addr[2] == PACKET_OUTGOING:  # our own sends on this port, seen again
                    continue
                seq += 1
                heapq.heappush(due, (now + delay_s, seq, other[sock], frame))
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, _, out, frame = heapq.heappop(due)
            with contextlib.suppress(OSError):  # the far end is down (a cut cable): the frame is lost, as on a wire
                out.send(frame)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    run(sys.argv[1], sys.argv[2], float(sys.argv[3]))
