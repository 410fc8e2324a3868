"""`refusing`: which addresses refuse a TCP connection. The probe takes a raylet whose port refuses for
a dead node at once, instead of waiting out a placement there (2 s, the last seconds of a node failure's
recovery in the chaos benchmark)."""

from __future__ import annotations

import socket

from service.pool.placement import refusing


def test_a_closed_port_refuses_a_listening_one_does_not_and_no_address_is_not_judged():
    listening = socket.create_server(("127.0.0.1", 0))
    closed = socket.create_server(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    try:
        addrs = {"up": ("127.0.0.1", listening.getsockname()[1]), "gone": ("127.0.0.1", closed_port),
                 "unknown": (None, None)}
        assert refusing(addrs) == {"gone"}
    finally:
        listening.close()


def test_nothing_to_try_is_nothing_refused():
    assert refusing({}) == set()
