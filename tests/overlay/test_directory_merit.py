"""PeerDirectory admission by merit: a full directory evicts its least valuable peer
(never seen up, then oldest) for a newcomer, never one the heartbeat saw up; forget()
drops a peer the heartbeat gave up on."""

from __future__ import annotations

from prefixmesh.overlay import discovery
from prefixmesh.overlay.core import admission
from prefixmesh.overlay.core.identity import Identity
from prefixmesh.overlay.discovery import PeerDirectory


def test_a_full_directory_evicts_by_merit(monkeypatch):
    monkeypatch.setattr(discovery, "MAX_PEERS", 3)
    d = PeerDirectory(Identity.generate().peer_id)
    peers = [Identity.generate().peer_id for _ in range(6)]
    for i, p in enumerate(peers[:3]):
        assert d.learn(p, [f"/ip4/10.0.{i}.1/tcp/4001"], "gossip")
        d.peers[p].first_seen = float(i)  # a deterministic age order
    up = {peers[0]}
    d.merit = lambda p: admission.SEEN_UP if p in up else admission.NEVER_UP
    assert d.learn(peers[3], ["/ip4/10.0.9.1/tcp/4001"], "gossip")
    assert set(d.peers) == {peers[0], peers[2], peers[3]}  # the oldest hint went
    assert d.evicted == 1
    up.update(d.peers)
    assert not d.learn(peers[4], ["/ip4/10.0.8.1/tcp/4001"], "gossip")  # all valued
    assert set(d.peers) == {peers[0], peers[2], peers[3]}
    d.forget(peers[2])
    assert d.learn(peers[5], ["/ip4/10.0.7.1/tcp/4001"], "gossip")
    assert peers[5] in d.peers and peers[2] not in d.peers
