"""overlay/ports.py: a fixed listen port another process holds is refused before the node
starts anything slow (py-libp2p's SO_REUSEPORT would share it silently)."""

from __future__ import annotations

import socket

import pytest

from prefixmesh.overlay.ports import HostError, ListenAddrInUse, check_listen_addrs_free, note_bound


def _held_port() -> socket.socket:
    held = socket.socket()
    # as py-libp2p listens: SO_REUSEPORT, which would let a second listener share it
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    held.bind(("127.0.0.1", 0))
    held.listen()
    return held


def test_check_listen_addrs_free_refuses_a_taken_port_and_a_foreign_address():
    with _held_port() as held:
        port = held.getsockname()[1]
        with pytest.raises(ListenAddrInUse, match=f"TCP port {port} is already in use"):
            check_listen_addrs_free([f"/ip4/127.0.0.1/tcp/{port}"])
    check_listen_addrs_free([f"/ip4/127.0.0.1/tcp/{port}"])  # closed: free again
    check_listen_addrs_free(["/ip4/127.0.0.1/tcp/0"])  # port 0 is never checked
    check_listen_addrs_free(["/ip4/127.0.0.1/udp/4001/quic"])  # not TCP: not ours to check
    with pytest.raises(ListenAddrInUse, match="cannot listen there"):
        check_listen_addrs_free(["/ip4/192.0.2.1/tcp/4001"])  # TEST-NET: not ours
    assert issubclass(ListenAddrInUse, HostError)  # the daemon's one-line error family


def test_a_port_this_process_listens_on_is_not_refused_again():
    with _held_port() as held:
        port = held.getsockname()[1]
        note_bound([f"/ip4/127.0.0.1/tcp/{port}", "/ip4/127.0.0.1/tcp/0"])
        check_listen_addrs_free([f"/ip4/127.0.0.1/tcp/{port}"])  # ours: let be
