"""Small networking helpers: free ports, this host's address, bounded waits."""

from __future__ import annotations

import random
import socket

# Ports below the kernel's ephemeral range are never handed out as the source port of an outgoing connection, so a
# port found free there stays free until its server binds it (unless another server binds it first); one the OS
# picks with bind(0) comes from the ephemeral range, where any process's next connection may take it meanwhile.
_LOWEST_PORT = 10000
_RNG = random.SystemRandom()  # not the seeded global RNG: ranks seeded alike would all try the same ports


def _ephemeral_range() -> tuple[int, int] | None:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return None


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``: one below the kernel's ephemeral port range when there is
    room there (an outgoing connection cannot take it before its server binds it), else one the OS picks."""
    span = _ephemeral_range()
    if span is not None and span[0] - _LOWEST_PORT >= 1000:
        for port in _RNG.sample(range(_LOWEST_PORT, span[0]), 64):
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def host_address() -> str:
    """The address other nodes reach this host on (best effort; never 0.0.0.0)."""
    name = socket.gethostname()
    try:
        addr = socket.gethostbyname(name)
        if not addr.startswith("127."):
            return addr
    except OSError:
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False
