"""Two real hosts on one machine, for `mpirun` across hosts (issue 31, docs/RUNTIME.md "Across hosts").

Each host is a network namespace with its own network stack: loopback up and one end of a veth pair addressed in
198.18.0.0/24 (198.18.0.0/15 is set aside for network benchmarking, RFC 2544: never a private or public range);
the other ends are joined by a bridge in the root namespace, which gets no address. mpirun runs inside host A
(its own UTS namespace, hostname A) and starts host B's daemon through a launcher agent, the `plm_ssh_agent`
script written here, which enters B's network namespace and a new UTS namespace named B. The file system, the
process table and /dev/shm stay shared, so the MCA settings keep the ranks on TCP (btl tcp,self; see MCA_ARGS).

`namespace_hosts()` creates everything and removes every namespace, link, bridge and process it made in a
`finally`, even when the body fails; `leftovers()` is what a test asserts empty after teardown.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SUBNET = "198.18.0.0/24"  # RFC 2544 benchmarking range
MCA_ARGS = ("--mca", "pml", "ob1",  # without it the launch hung (issue 31): ob1 = the point-to-point over the BTLs below
            "--mca", "btl", "tcp,self",  # no shared memory: the namespaces share /dev/shm, real hosts do not
            "--mca", "btl_tcp_if_include", SUBNET,  # the ranks' traffic on the hosts' veth, not loopback
            "--prtemca", "oob_tcp_if_include", SUBNET)  # the daemons' out-of-band channel too  # fmt: skip
# Optional: the daemons' TCP keepalive, short, so a silent link (a cable pulled, a switch port dead: no reset comes
# back) is noticed by prterun and by the far host's prted within ~3 + 3 x 1 s. Without it Open MPI keeps waiting on
# the silent connection (docs/RUNTIME.md "Across hosts", link cut).
KEEPALIVE_ARGS = ("--prtemca", "oob_tcp_keepalive_time", "3", "--prtemca", "oob_tcp_keepalive_intvl", "1",
                  "--prtemca", "oob_tcp_keepalive_probes", "3")  # fmt: skip


def unavailable() -> str | None:
    """Why namespace hosts cannot be made here (a skip reason), or None."""
    if os.geteuid() != 0:
        return "namespace hosts need root (ip netns add)"
    for tool in ("ip", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"ip netns unavailable: {probe.stderr.strip()}"
    return None


@dataclass(frozen=True)
class Hosts:
    """What a test needs to launch across the two namespace hosts."""

    names: tuple[str, str]  # the hosts (= their network namespaces and hostnames)
    addresses: tuple[str, str]
    hostfile: Path
    agent: Path  # the plm_ssh_agent script
    bridge: str
    veths: tuple[str, str]  # the root-namespace ends
    same_hostname: bool

    def enter(self, host: str) -> list[str]:
        """argv prefix that runs a command inside `host` (its network namespace, and hostname unless same_hostname)."""
        if self.same_hostname:
            return ["ip", "netns", "exec", host]
        return ["ip", "netns", "exec", host, "unshare", "--uts", "sh", "-c", f'hostname {host} && exec "$@"', "sh"]

    def mpirun_argv(self, mpirun: str, np_: int = 2, *extra: str) -> list[str]:
        """argv prefix: mpirun started inside host A, one rank per host (--map-by node), with the MCA settings;
        append the program and its arguments."""
        return [*self.enter(self.names[0]), mpirun, "-np", str(np_), "--hostfile", str(self.hostfile),
                "--map-by", "node", "--mca", "plm_ssh_agent", str(self.agent), *MCA_ARGS,
                "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", *extra]  # fmt: skip

    def pids(self, host: str) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def veth(self, host: str) -> str:
        """The root-namespace end of `host`'s link: the host's "cable" into the bridge (its "switch port")."""
        return self.veths[self.names.index(host)]

    def kill_all(self, host: str, sig: int = signal.SIGKILL) -> list[int]:
        """Send `sig` to every process inside host's namespace; the pids signalled."""
        pids = self.pids(host)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pids


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def _links() -> set[str]:
    out = _ip("-o", "link", "show").stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line}


def qdisc_unavailable(kind: str) -> str | None:
    """Why this kernel cannot attach a `kind` queueing discipline (tc qdisc; netem needs the sch_netem module),
    probed on a throwaway veth pair in a throwaway namespace; None when it can."""
    if shutil.which("tc") is None:
        return "tc (iproute2) not found"
    probe = f"mtpq{os.getpid() % 100000:05d}"
    try:
        _ip("netns", "add", probe)
        _ip("-n", probe, "link", "add", "q0", "type", "veth", "peer", "name", "q1")
        args = {"netem": ["delay", "1ms"], "tbf": ["rate", "1mbit", "burst", "32kbit", "latency", "400ms"]}[kind]
        proc = subprocess.run(["tc", "-n", probe, "qdisc", "add", "dev", "q0", "root", kind, *args],
                              capture_output=True, text=True, timeout=30)  # fmt: skip
        return None if proc.returncode == 0 else f"tc qdisc {kind}: {proc.stderr.strip()} (kernel lacks sch_{kind})"
    finally:
        _ip("netns", "delete", probe, check=False)


@contextlib.contextmanager
def link_down(hosts: Hosts, host: str) -> Iterator[None]:
    """`host`'s cable pulled: its root-side veth down (the host's own eth0 loses carrier; nothing is sent back, so
    the other host's TCP connections to it just go silent). Restored on leaving the block."""
    _ip("link", "set", hosts.veth(host), "down")
    try:
        yield
    finally:
        _ip("link", "set", hosts.veth(host), "up", check=False)


@contextlib.contextmanager
def shaped_link(hosts: Hosts, qdisc: list[str]) -> Iterator[None]:
    """Every host's outgoing traffic shaped by `tc qdisc add dev eth0 root QDISC` in its namespace, so both
    directions are: ["netem", "delay", "50ms"] is 50 ms each way (100 ms round trip). Removed on leaving."""
    try:
        for host in hosts.names:
            proc = subprocess.run(["tc", "-n", host, "qdisc", "add", "dev", "eth0", "root", *qdisc],
                                  capture_output=True, text=True, timeout=30)  # fmt: skip
            if proc.returncode != 0:
                raise RuntimeError(f"tc qdisc add ... {' '.join(qdisc)} in {host} failed: {proc.stderr.strip()}")
        yield
    finally:
        for host in hosts.names:
            subprocess.run(["tc", "-n", host, "qdisc", "del", "dev", "eth0", "root"], capture_output=True, timeout=30)


@contextlib.contextmanager
def delayed_link(hosts: Hosts, delay_s: float) -> Iterator[str]:
    """The hosts' link made slow: netem's `delay` on each host's eth0 where the kernel has sch_netem, else both
    root-side veths taken off the bridge and joined by a userspace delay line (tests/delay_line.py) that sends
    every frame on DELAY_S later. Either way each direction is DELAY_S (round trip 2 x DELAY_S). Yields which was
    used; on leaving, the delay line is stopped and the veths are back on the bridge."""
    if qdisc_unavailable("netem") is None:
        with shaped_link(hosts, ["netem", "delay", f"{round(delay_s * 1000)}ms"]):
            yield "netem"
        return
    for veth in hosts.veths:
        _ip("link", "set", veth, "nomaster")
    line = subprocess.Popen([sys.executable, "-m", "tests.delay_line", *hosts.veths, str(delay_s)],
                            cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        if line.stdout is None or line.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the delay line did not start (status {line.wait(timeout=30)})")
        yield "delay line"
    finally:
        line.terminate()
        try:
            line.wait(timeout=10)
        except subprocess.TimeoutExpired:
            line.kill()
            line.wait()
        for veth in hosts.veths:
            _ip("link", "set", veth, "master", hosts.bridge, check=False)


def leftovers(hosts: Hosts) -> list[str]:
    """The namespaces and links of `hosts` that still exist (empty after a clean teardown)."""
    namespaces = {line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()}
    left = [f"netns {n}" for n in hosts.names if n in namespaces]
    links = _links()
    left += [f"link {name}" for name in (hosts.bridge, *hosts.veths) if name in links]
    return left


AGENT = """#!/bin/sh
# plm_ssh_agent for namespace hosts (tests/multihost.py): called as `AGENT [options] HOST COMMAND...` like ssh;
# runs COMMAND inside HOST's network namespace with the hostname HOST. Not `exec`: like an ssh client, this
# process stays on the launching host and exits non-zero when the remote side is killed.
while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
host=$1; shift
ip netns exec "$host" {uts}"$*"
"""


@contextlib.contextmanager
def namespace_hosts(workdir: Path, same_hostname: bool = False, slots: int = 1) -> Iterator[Hosts]:
    """Create the two namespace hosts (names unique to this process), yield them, and always remove them."""
    tag = f"{os.getpid() % 100000:05d}"
    names = (f"mtp{tag}a", f"mtp{tag}b")
    addresses = ("198.18.0.11", "198.18.0.12")
    bridge, veths = f"mtpbr{tag}", (f"mtpv{tag}a", f"mtpv{tag}b")
    workdir.mkdir(parents=True, exist_ok=True)
    hostfile = workdir / "hostfile"
    hostfile.write_text("".join(f"{n} slots={slots}\n" for n in names))
    agent = workdir / "ns_agent.sh"
    uts = "sh -c " if same_hostname else 'unshare --uts sh -c "hostname $host; "'
    agent.write_text(AGENT.replace("{uts}", uts))
    agent.chmod(0o755)
    hosts = Hosts(names, addresses, hostfile, agent, bridge, veths, same_hostname)
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("link", "set", bridge, "up")
        for name, veth, addr in zip(names, veths, addresses, strict=True):
            _ip("netns", "add", name)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
            _ip("link", "set", veth, "master", bridge)
            _ip("link", "set", veth, "up")
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
        yield hosts
    finally:
        teardown(hosts)


def teardown(hosts: Hosts) -> None:
    """Kill every process in both namespaces, then delete the namespaces, veths and bridge (each step tolerant)."""
    for _ in range(3):
        for name in hosts.names:
            with contextlib.suppress(Exception):
                hosts.kill_all(name)
        if not any(_safe_pids(hosts, n) for n in hosts.names):
            break
        time.sleep(0.2)
    for name in hosts.names:
        _ip("netns", "delete", name, check=False)
    for link in (*hosts.veths, hosts.bridge):
        _ip("link", "delete", link, check=False)


def _safe_pids(hosts: Hosts, name: str) -> list[int]:
    try:
        return hosts.pids(name)
    except Exception:  # noqa: BLE001 - the namespace may be gone already
        return []
