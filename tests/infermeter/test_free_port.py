"""free_port: ports asked for together, and bound later, are distinct."""

from __future__ import annotations

import collections
import socket

import pytest

from infermeter import serving
from infermeter.serving import PortInUseError, free_port


def test_ports_asked_for_before_any_is_bound_are_distinct() -> None:
    """A thousand ports asked for in a row, none bound meanwhile (the OS alone repeats some: about
    18 pairs among 1,000 in its range of 28,000): no port twice, and each bindable."""
    ports = [free_port() for _ in range(1000)]
    assert len(set(ports)) == 1000
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))


def test_a_port_the_os_offers_again_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """When the OS offers a port it just handed out (the probe closed, nobody bound it yet),
    another is taken; when it offers nothing else, that is an error, not a duplicate."""
    first = free_port()
    offered = iter([first, first, first + 1 if first < 65535 else first - 1])
    real = socket.socket

    class Offering(real):  # type: ignore[misc,valid-type]
        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", next(offered))

    monkeypatch.setattr(socket, "socket", Offering)
    second = free_port()
    assert second != first
    monkeypatch.setattr(serving, "_HANDED_OUT", collections.deque([first], maxlen=8))
    offered = iter([first] * 64)
    with pytest.raises(PortInUseError, match="handed out lately"):
        free_port()
