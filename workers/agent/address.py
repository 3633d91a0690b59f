"""The address an agent's cluster members are reached at, as other hosts see it (issue 41 §2).

``--advertise-address`` when given; else the source address of this host's route to the Prefect
server: a UDP socket ``connect()`` to the API's host, then ``getsockname()`` (the kernel picks the
route and its source address; no packet is sent). An agent whose server is on its own loopback
publishes 127.0.0.1: every member of its runs is then on this machine.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Optional
from urllib.parse import urlsplit

LOOPBACK = "127.0.0.1"


def route_source(host: str, port: int = 80) -> str:
    """The local address the kernel would send from to reach ``host`` (resolved, IPv4 first)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    infos.sort(key=lambda i: i[0] != socket.AF_INET)
    last: Optional[OSError] = None
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(sockaddr)  # UDP: no packet, only the route lookup
                return s.getsockname()[0]
        except OSError as exc:
            last = exc
    raise OSError(f"no route to {host}: {last}")


def detect_address(api_url: Optional[str]) -> str:
    """The source address of the route to the Prefect server at ``api_url`` (loopback when none)."""
    parts = urlsplit(api_url or "")
    if not parts.hostname:
        return LOOPBACK
    try:
        return route_source(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
    except OSError:
        return LOOPBACK


def check_address(value: str) -> str:
    """An ``--advertise-address``: an IP address or a host name (checked for form, not resolved)."""
    value = value.strip()
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        pass
    labels = value.rstrip(".").split(".")
    if value and all(lbl and len(lbl) <= 63 and all(c.isalnum() or c == "-" for c in lbl) for lbl in labels):
        return value
    raise ValueError(f"--advertise-address {value!r} is neither an IP address nor a host name")


def agent_address(advertise: Optional[str] = None, api_url: Optional[str] = None) -> str:
    """``advertise`` when given, else the detected route source to the server."""
    if advertise:
        return check_address(advertise)
    if api_url is None:
        from prefect.settings import PREFECT_API_URL

        api_url = PREFECT_API_URL.value()
    return detect_address(api_url)


def bind_host(address: str) -> str:
    """Where a member's rendezvous listens: ``address`` when it is one of this host's, else every address
    (an advertised address behind NAT or a host name is not bindable here)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
        return address
    except (OSError, socket.gaierror):
        return "0.0.0.0"
