"""miles.utils.net.find_free_port: a port below the ephemeral range, free, and not drawn from the seeded RNG."""

from __future__ import annotations

import random
import socket

import pytest

from miles.utils import net


def test_free_port_is_below_the_ephemeral_range_and_bindable() -> None:
    span = net._ephemeral_range()
    if span is None or span[0] - net._LOWEST_PORT < 1000:
        pytest.skip("no /proc ephemeral port range with room below it on this machine")
    ports = {net.find_free_port() for _ in range(20)}
    assert all(net._LOWEST_PORT <= p < span[0] for p in ports), ports
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_ranks_seeded_alike_do_not_draw_the_same_ports() -> None:
    got = []
    for _ in range(2):
        random.seed(1234)                      # what --seed does in every rank
        got.append([net.find_free_port() for _ in range(5)])
    assert got[0] != got[1]


def test_a_busy_port_is_skipped(monkeypatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy, \
            socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        busy.bind(("127.0.0.1", 0))
        probe.bind(("127.0.0.1", 0))
        taken, free = busy.getsockname()[1], probe.getsockname()[1]
        probe.close()
        monkeypatch.setattr(net, "_ephemeral_range", lambda: (net._LOWEST_PORT + 5000, 60999))
        monkeypatch.setattr(net._RNG, "sample", lambda pop, k: [taken, free])
        assert net.find_free_port() == free
