"""PeerDirectory: what discovery sources feed in, and when the heartbeat is (re)started."""

from __future__ import annotations

from prefixmesh.overlay.core.identity import Identity
from prefixmesh.overlay.discovery import MAX_ADDRS_PER_PEER, PeerDirectory, providers_key


def test_directory_learns_filters_and_rewatches():
    me, peer = Identity.generate().peer_id, Identity.generate().peer_id
    calls = []
    d = PeerDirectory(me, on_new_peer=calls.append)
    assert not d.learn(me, ["/ip4/127.0.0.1/tcp/1"], "gossip")  # never ourselves
    assert d.learn(peer, ["/ip4/127.0.0.1/tcp/1/p2p/x", "/ip4/0.0.0.0/tcp/2", "/udp/3"], "mdns")
    assert d.addrs_of(peer) == ["/ip4/127.0.0.1/tcp/1"]  # /p2p stripped, 0.0.0.0 and non-TCP dropped
    assert calls == [peer]
    assert not d.learn(peer, ["/ip4/127.0.0.1/tcp/1"], "gossip")  # nothing new: no callback
    assert calls == [peer] and d.sources_of(peer) == {"mdns", "gossip"}
    d.learn(peer, ["/ip4/127.0.0.1/tcp/9"], "dht")  # new address: watch again (idempotent)
    assert calls == [peer, peer] and d.addrs_of(peer)[0] == "/ip4/127.0.0.1/tcp/9"
    d.learn(peer, [f"/ip4/127.0.0.1/tcp/{100 + i}" for i in range(20)], "gossip")
    assert len(d.addrs_of(peer)) == MAX_ADDRS_PER_PEER


def test_providers_key_depends_on_model():
    a, b = providers_key(b"model-a"), providers_key(b"model-b")
    assert a != b and a.startswith("1220") and len(bytes.fromhex(a)) == 34


def test_directory_ignores_peer_ids_that_are_not_ed25519_identities():
    """An RSA or secp256k1 libp2p node answering mDNS (or any junk id) is ignored and
    counted, never half-registered (SECURITY.md section 4)."""
    me = Identity.generate().peer_id
    calls = []
    d = PeerDirectory(me, on_new_peer=calls.append)
    for junk in (b"", b"\x00" * 34, b"\x12\x20" + b"\x01" * 32, b"not a peer id"):
        assert not d.learn(junk, ["/ip4/127.0.0.1/tcp/1"], "mdns")
    assert d.peers == {} and calls == [] and d.invalid_ids == 4


def test_own_peer_id_at_another_address_is_an_error_naming_both(caplog):
    import logging

    from prefixmesh.overlay.core.identity import Identity
    from prefixmesh.overlay.discovery import PeerDirectory

    me = Identity.generate().peer_id
    d = PeerDirectory(me, self_addrs=lambda: ["/ip4/127.0.0.1/tcp/4001"])
    with caplog.at_level(logging.ERROR, logger="prefixmesh.overlay.discovery"):
        assert not d.learn(me, ["/ip4/127.0.0.1/tcp/4001"], "mdns")  # ourselves: fine
        assert not d.learn(me, ["/dns/boot.example.org/tcp/4001"], "bootstrap")  # maybe us
        assert not d.learn(me, ["/ip4/10.0.0.7/tcp/4001/p2p/x"], "bootstrap")
        assert not d.learn(me, ["/ip4/10.0.0.7/tcp/4001"], "mdns")  # once per address
    (rec,) = caplog.records
    text = rec.getMessage()
    assert "10.0.0.7/tcp/4001" in text and "127.0.0.1/tcp/4001" in text and "bootstrap" in text
    assert me not in d.peers


def test_own_previous_run_on_our_own_ip_via_mdns_is_not_an_impostor(caplog):
    import logging

    from prefixmesh.overlay.core.identity import Identity
    from prefixmesh.overlay.discovery import PeerDirectory

    me = Identity.generate().peer_id
    d = PeerDirectory(me, self_addrs=lambda: ["/ip4/192.168.1.5/tcp/4001"])
    with caplog.at_level(logging.ERROR, logger="prefixmesh.overlay.discovery"):
        d.learn(me, ["/ip4/192.168.1.5/tcp/39999"], "mdns")  # our last run's stale record
        assert not caplog.records
        d.learn(me, ["/ip4/192.168.1.5/tcp/39999"], "bootstrap")  # configured: it counts
    assert len(caplog.records) == 1
