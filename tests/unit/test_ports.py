"""`free_port` picks below the kernel's ephemeral range, where no port-0 bind can take it before it is used."""

from __future__ import annotations

import itertools
import socket

from megatron_omni.parallel import ports


def test_free_ports_are_below_the_ephemeral_range_and_bindable() -> None:
    low = ports._ephemeral_low()
    picked = {ports.free_port() for _ in range(20)}
    assert len(picked) > 1  # random, not one fixed port that two workers would share
    for port in picked:
        assert ports._LOWEST <= port < low, (port, low)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_taken_port_is_never_returned(monkeypatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        # The first random draws land on the held port, then on the ports from the bottom of the range up.
        draws = itertools.chain([taken] * 3, range(ports._LOWEST, 65_000))
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: 65_000)
        monkeypatch.setattr(ports.random.SystemRandom, "randrange", lambda self, a, b: next(draws))
        assert ports.free_port() != taken
