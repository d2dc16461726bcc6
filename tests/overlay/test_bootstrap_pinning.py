"""Bootstrap pinning: a bootstrap multiaddr names its peer id, and only that peer counts.

An eclipse attempt: node N is configured with ``/ip4/127.0.0.1/tcp/PORT/p2p/<X>``, but the
process listening on PORT is another node Y (it took the port, or a network attacker
redirects it). Noise's handshake authenticates the responder's static key, which is bound
to its libp2p identity key, so N's dial finds "Y" where it expected "X" and fails; N keeps
no connection to Y and never records Y as a peer. N keeps retrying (``bootstrap_loop``'s
backoff) and reaches X once X really listens there, and meanwhile connects to any honest
bootstrap peer it was given.

Real :class:`OverlayHost` s over 127.0.0.1 in one process; no model. Also here: the config
refuses an unpinned bootstrap address, and a DHT address record whose body names peer B
but which A signed is rejected by the DHT validator (signature check, not just the key).
"""

from __future__ import annotations

import logging

import cbor2
import pytest
import trio
from _swarm import free_port

from prefixmesh.node.config import ConfigError, load_config
from prefixmesh.overlay.core.identity import Identity
from prefixmesh.overlay.discovery import (
    _DHT_RECORD_LABEL,  # the signing domain label
    DhtRecordError,
    PeerDirectory,
    PrefixmeshValidator,
    bootstrap_loop,
    decode_dht_record,
    encode_dht_record,
)
from prefixmesh.overlay.host import OverlayHost, PeerUnreachable, split_p2p_addr

WAIT_S = 20.0  # generous: a busy 2-core machine


async def _until(predicate, what: str, timeout_s: float = WAIT_S) -> None:
    with trio.move_on_after(timeout_s):
        while not predicate():
            await trio.sleep(0.05)
        return
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_a_dial_to_an_impostor_fails_and_leaves_no_trace(caplog):
    """The direct form: connect(X, [where Y listens]) raises; no connection either side.
    The TCP connection itself succeeds: what fails is the Noise handshake (logged by
    libp2p), because Y cannot prove it holds X's key."""
    x, y, n = Identity.generate(), Identity.generate(), Identity.generate()

    async def main():
        impostor = OverlayHost(y, ["/ip4/127.0.0.1/tcp/0"])
        node = OverlayHost(n, [])
        async with impostor.run(), node.run():
            where_y_listens = impostor.listen_addrs()[0]
            # the libp2p logger's own level: a client command run earlier in this process
            # (prefixmesh.cli's quiet mode) may have raised it to CRITICAL
            with caplog.at_level(logging.DEBUG, logger="libp2p"), \
                    pytest.raises(PeerUnreachable):
                await node.connect(x.peer_id, [where_y_listens], timeout_s=10.0)
            assert any("handshake failed" in r.getMessage() for r in caplog.records), [
                r.getMessage() for r in caplog.records]
            assert node.connected_peers() == []
            assert not node.is_connected(y.peer_id) and not node.is_connected(x.peer_id)
            await _until(lambda: n.peer_id not in impostor.connected_peers(),
                         "the impostor to drop the failed handshake")
            # control: the same dial to the id that really listens there succeeds
            await node.connect(y.peer_id, [where_y_listens], timeout_s=10.0)
            assert node.connected_peers() == [y.peer_id]

    trio.run(main)


def test_bootstrap_to_an_impersonated_address_is_not_eclipsed():
    x, y, z, n = (Identity.generate() for _ in range(4))
    port = free_port()
    pinned_x = f"/ip4/127.0.0.1/tcp/{port}/p2p/{x.peer_id_b58}"

    async def main():
        honest = OverlayHost(z, ["/ip4/127.0.0.1/tcp/0"])
        impostor = OverlayHost(y, [f"/ip4/127.0.0.1/tcp/{port}"])
        node = OverlayHost(n, [], dial_timeout_s=5.0)
        learned: list[bytes] = []
        directory = PeerDirectory(n.peer_id, on_new_peer=learned.append)
        async with honest.run(), node.run(), trio.open_nursery() as nursery:
            async with impostor.run():
                nursery.start_soon(lambda: bootstrap_loop(
                    node, directory, [pinned_x, honest.full_addrs()[0]],
                    retry_min_s=0.1, retry_max_s=0.3))
                # the honest bootstrap peer is reached while the impostor holds X's address
                await _until(lambda: node.is_connected(z.peer_id), "N to reach Z")
                # give the loop several tries against the impostor
                await trio.sleep(1.5)
                assert not node.is_connected(y.peer_id)
                assert not node.is_connected(x.peer_id)
                assert set(node.connected_peers()) == {z.peer_id}
                assert set(directory.peers) == {x.peer_id, z.peer_id}  # Y never learned
                assert y.peer_id not in learned
                assert n.peer_id not in impostor.connected_peers()
            # the impostor is gone; the real X takes its port: N's retries now reach X
            real_x = OverlayHost(x, [f"/ip4/127.0.0.1/tcp/{port}"])
            async with real_x.run():
                await _until(lambda: node.is_connected(x.peer_id), "N to reach the real X")
                assert set(node.connected_peers()) == {x.peer_id, z.peer_id}
                assert directory.addrs_of(x.peer_id) == [f"/ip4/127.0.0.1/tcp/{port}"]
                assert directory.sources_of(x.peer_id) == {"bootstrap"}
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_unpinned_bootstrap_addresses_are_refused(tmp_path):
    unpinned = "/ip4/127.0.0.1/tcp/4001"
    with pytest.raises(ConfigError) as info:
        load_config(text=f'[node]\nbootstrap = ["{unpinned}"]\n')
    assert str(info.value).startswith("[node].bootstrap: [0] ")
    assert "lacks the peer id" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(overrides={"node.bootstrap": [unpinned]})
    assert "--bootstrap" in str(info.value) and "lacks the peer id" in str(info.value)
    # and below the config, the address splitter refuses it too (bootstrap_loop skips it)
    with pytest.raises(ValueError, match="no /p2p/"):
        split_p2p_addr(unpinned)


def test_bootstrap_loop_skips_an_unpinned_address_and_returns():
    n = Identity.generate()

    async def main():
        node = OverlayHost(n, [])
        directory = PeerDirectory(n.peer_id)
        async with node.run():
            with trio.fail_after(5):
                await bootstrap_loop(node, directory, ["/ip4/127.0.0.1/tcp/4001"])
        assert directory.peers == {}

    trio.run(main)


def test_a_dht_record_signed_by_a_but_naming_b_is_rejected():
    a, b = Identity.generate(), Identity.generate()
    key_b = f"/prefixmesh/{b.peer_id_b58}"
    # A writes a body that names B (B's id, an attacker's address) and signs it with its
    # own key, exactly as encode_dht_record would: a valid signature, by the wrong peer
    body = cbor2.dumps([b.peer_id, ["/ip4/6.6.6.6/tcp/6"], 300.0], canonical=True)
    sig_by_a = a.sign(_DHT_RECORD_LABEL + body)
    assert a.verify(_DHT_RECORD_LABEL + body, sig_by_a)
    forged = cbor2.dumps([body, sig_by_a], canonical=True)
    v = PrefixmeshValidator()
    with pytest.raises(DhtRecordError, match="bad signature"):
        v.validate(key_b, forged)
    # A's own genuine record stored under B's key: refused because the key names B
    genuine_a = encode_dht_record(a, ["/ip4/127.0.0.1/tcp/1"], 100.0)
    with pytest.raises(DhtRecordError, match="another peer"):
        v.validate(key_b, genuine_a)
    # B's genuine record is accepted, and select never picks a forged one, however new
    genuine_b = encode_dht_record(b, ["/ip4/127.0.0.1/tcp/2"], 200.0)
    assert decode_dht_record(key_b, genuine_b)[:2] == (b.peer_id, ["/ip4/127.0.0.1/tcp/2"])
    assert v.select(key_b, [forged, genuine_a, genuine_b]) == 2
