"""Several hosts on one machine, for tests and benchmarks (issue 41 §1): network namespaces on a bridge.

``namespace_hosts(n)`` makes ``n`` hosts, each a network namespace with its own address on a private
/24 (``10.77.<k>.0/24``, the first ``k`` not in use on this machine), joined by veth pairs to a Linux bridge
that holds ``.1`` in the root namespace: a server bound to the bridge address (``hosts.gateway``) is
reached from every host, and the hosts reach each other. Loopback is up in every namespace. What runs
inside a host is started with ``host.exec(...)`` (``nsenter --net``, or ``ip netns exec``); ``host.cut()`` /
``host.restore()`` take its link down and up (its root-side veth), for a host cut off mid-run.

Everything is removed when the block ends, also when the test fails or the process gets SIGTERM (turned
into KeyboardInterrupt while the block runs, so the ``finally`` runs). Names carry the creating process's pid
(``lh<pid>...``); a harness that starts also removes what a killed earlier process (a pid no longer alive)
left behind. ``unavailable()`` says why it cannot run here (not root, no ``ip``, ``ip netns`` refused);
tests skip with that reason.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Iterator, Optional

PREFIX = "lh"  # every namespace, bridge and veth of this harness: lh<pid>...
SUBNETS = "10.77"  # 10.77.<k>.0/24
NETNS_DIR = "/var/run/netns"  # where `ip netns add` pins a namespace


def _ip(*args: str, ns: Optional[str] = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


_why_not: Optional[tuple[Optional[str]]] = None


def unavailable() -> Optional[str]:
    """None when namespace hosts can be made here; else why not (the tests' skip reason). Checked once."""
    global _why_not
    if _why_not is None:
        _why_not = (_check(),)
    return _why_not[0]


def _check() -> Optional[str]:
    if not sys.platform.startswith("linux"):
        return "network namespace hosts need Linux"
    if os.geteuid() != 0:
        return "network namespace hosts need root (ip netns add); CI runs as root"
    if not shutil.which("ip"):
        return "network namespace hosts need iproute2's `ip` (apt-get install iproute2)"
    probe = f"{PREFIX}{os.getpid()}probe"
    try:
        _ip("netns", "add", probe)
        _ip("link", "set", "lo", "up", ns=probe)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns` does not work here: {exc}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    name: str  # the namespace
    addr: str  # its address on the bridge's subnet
    veth: str  # the root-namespace end of its veth pair (on the bridge)

    def exec(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host: its own network; the same file system, process table, users and
        cgroup hierarchies. ``nsenter --net`` (util-linux) enters the network namespace alone; ``ip netns
        exec`` (the fallback) also remounts /sys, which hides /sys/fs/cgroup from an agent (no memory
        groups: it would fall back to watching RSS)."""
        if shutil.which("nsenter"):
            return ["nsenter", f"--net={NETNS_DIR}/{self.name}", "--", *map(str, argv)]
        return ["ip", "netns", "exec", self.name, *map(str, argv)]

    def run(self, argv: list[str], **kw) -> subprocess.CompletedProcess:
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("timeout", 60)
        return subprocess.run(self.exec(argv), **kw)

    def cut(self) -> None:
        """The host is cut off: its link to the bridge goes down (what runs on it keeps running)."""
        _ip("link", "set", self.veth, "down")

    def restore(self) -> None:
        _ip("link", "set", self.veth, "up")


@dataclass
class Hosts:
    bridge: str
    gateway: str  # the bridge's address in the root namespace: bind servers the hosts reach here
    subnet: str
    hosts: list[Host] = field(default_factory=list)
    forward_rule: Optional[list[str]] = None  # an iptables rule added so bridged traffic is never dropped

    def __iter__(self):
        return iter(self.hosts)

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)


def _ours() -> tuple[set[str], set[str]]:
    """(namespaces, links) this harness made, by name, on this machine (any process)."""
    ns = {line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line.strip()}
    links = set(re.findall(r"^\d+:\s+([^:@\s]+)", _ip("-o", "link", "show", check=False).stdout, re.M))
    pat = re.compile(rf"^{PREFIX}(\d+)")
    return {n for n in ns if pat.match(n)}, {link for link in links if pat.match(link)}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def sweep_stale() -> list[str]:
    """Remove the namespaces and links a process that is gone left behind; returns their names."""
    removed = []
    namespaces, links = _ours()
    for name in sorted(namespaces | links):
        m = re.match(rf"^{PREFIX}(\d+)", name)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            if name in namespaces:
                _ip("netns", "del", name, check=False)
            else:
                _ip("link", "del", name, check=False)
            removed.append(name)
    if shutil.which("iptables"):  # the FORWARD rules their bridges had (_allow_bridged)
        rules = subprocess.run(["iptables", "-S", "FORWARD"], capture_output=True, text=True, timeout=30).stdout
        for bridge in re.findall(rf"^-A FORWARD -i ({PREFIX}\d+\w*br) -o \1 -j ACCEPT$", rules, re.M):
            pid = int(re.match(rf"^{PREFIX}(\d+)", bridge).group(1))
            if pid != os.getpid() and not _alive(pid):
                subprocess.run(["iptables", "-D", "FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"],
                               capture_output=True, timeout=30)
                removed.append(f"iptables FORWARD rule of {bridge}")
    return removed


def _free_subnet() -> int:
    used = set(re.findall(rf"\b{re.escape(SUBNETS)}\.(\d+)\.", _ip("-4", "-o", "addr", "show", check=False).stdout))
    for k in range(0, 256):
        if str(k) not in used:
            return k
    raise RuntimeError(f"no free {SUBNETS}.<k>.0/24 subnet for namespace hosts")


_lock = threading.Lock()
_seq = [0]


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """While the block runs, SIGTERM raises KeyboardInterrupt in the main thread, as Ctrl-C would: the
    ``finally`` blocks run (pytest also tears its fixtures down and stops the session)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def namespace_hosts(n: int) -> Iterator[Hosts]:
    """``n`` hosts on a fresh bridge (see the module docstring); all removed when the block ends."""
    why = unavailable()
    if why:
        raise RuntimeError(why)
    sweep_stale()
    with _lock:
        _seq[0] += 1
        tag = f"{PREFIX}{os.getpid()}{'abcdefghijklmnopqrstuvwxyz'[_seq[0] % 26]}"  # <= 11 chars, + suffixes <= 15
        k = _free_subnet()
        net = ipaddress.ip_network(f"{SUBNETS}.{k}.0/24")
        bridge = f"{tag}br"
        hosts = Hosts(bridge=bridge, gateway=str(net[1]), subnet=str(net))
        made_ns: list[str] = []
        with _sigterm_raises():
            try:
                _ip("link", "add", bridge, "type", "bridge")
                _ip("addr", "add", f"{hosts.gateway}/{net.prefixlen}", "dev", bridge)
                _ip("link", "set", bridge, "up")
                for i in range(n):
                    ns, veth, peer = f"{tag}h{i}", f"{tag}v{i}", f"{tag}p{i}"
                    _ip("netns", "add", ns)
                    made_ns.append(ns)
                    _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
                    _ip("link", "set", peer, "netns", ns)
                    _ip("link", "set", peer, "name", "eth0", ns=ns)
                    addr = str(net[2 + i])
                    _ip("addr", "add", f"{addr}/{net.prefixlen}", "dev", "eth0", ns=ns)
                    _ip("link", "set", "eth0", "up", ns=ns)
                    _ip("link", "set", "lo", "up", ns=ns)
                    _ip("link", "set", veth, "master", bridge)
                    _ip("link", "set", veth, "up")
                    hosts.hosts.append(Host(name=ns, addr=addr, veth=veth))
                hosts.forward_rule = _allow_bridged(bridge)
            except BaseException:
                _teardown(hosts, made_ns)
                raise
    try:
        with _sigterm_raises():
            yield hosts
    finally:
        _teardown(hosts, made_ns)


def _allow_bridged(bridge: str) -> Optional[list[str]]:
    """Where bridged frames pass iptables (br_netfilter) and FORWARD drops (e.g. after dockerd started):
    accept this bridge's own traffic. Best effort; returns the rule to delete later."""
    if not shutil.which("iptables"):
        return None
    rule = ["FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"]
    done = subprocess.run(["iptables", "-I", *rule], capture_output=True, timeout=30)
    return rule if done.returncode == 0 else None


def _teardown(hosts: Hosts, namespaces: list[str]) -> None:
    """Kill what still runs inside the namespaces, then remove them (their veths go with them) and the bridge."""
    for ns in namespaces:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _ip("netns", "del", ns, check=False)
    _ip("link", "del", hosts.bridge, check=False)
    for h in hosts.hosts:
        _ip("link", "del", h.veth, check=False)
    if hosts.forward_rule:
        subprocess.run(["iptables", "-D", *hosts.forward_rule], capture_output=True, timeout=30)


def host_agent_args(host: Host, cli: list[str], queues: list[str], name: str, capacity: str,
                    extra: tuple[str, ...] = (), on_exit: str = "cancel") -> list[str]:
    """``prefect-launch agent`` inside ``host`` (see launch_helpers.host_agent for the running one)."""
    args = [*cli, "agent", "--name", name, "--capacity", capacity, "--on-exit", on_exit, *extra]
    for q in queues:
        args += ["--queue", q]
    return host.exec(args)


def reachable(host: Host, addr: str, port: int, timeout: float = 3.0) -> bool:
    """Whether a TCP connection from inside ``host`` to ``addr:port`` is accepted."""
    code = (f"import socket; socket.create_connection(({addr!r}, {port}), timeout={timeout}).close()")
    return host.run([sys.executable, "-c", code], timeout=timeout + 10).returncode == 0


def pids_in(host: Host) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", host.name], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]

