"""Kademlia DHT discovery between real node processes (digests off, so the DHT is the
only way to learn peers that are not configured), and our signed DHT record validator."""

from __future__ import annotations

import time

import cbor2
import pytest
from _swarm import Swarm, peers, wait_until  # noqa: E402

from prefixmesh.overlay.core.identity import Identity  # noqa: E402
from prefixmesh.overlay.discovery import (  # noqa: E402
    DhtRecordError,
    PrefixmeshValidator,
    decode_dht_record,
    encode_dht_record,
)


def test_validator_checks_writer_and_prefers_newest():
    me, other = Identity.generate(), Identity.generate()
    key = f"/prefixmesh/{me.peer_id_b58}"
    old = encode_dht_record(me, ["/ip4/127.0.0.1/tcp/1"], 100.0)
    new = encode_dht_record(me, ["/ip4/127.0.0.1/tcp/2"], 200.0)
    forged = encode_dht_record(other, ["/ip4/6.6.6.6/tcp/6"], 300.0)  # names other, not me
    v = PrefixmeshValidator()
    v.validate(key, old)
    with pytest.raises(DhtRecordError):
        v.validate(key, forged)
    body, sig = cbor2.loads(new)
    tampered = cbor2.dumps([body, bytes([sig[0] ^ 1]) + sig[1:]], canonical=True)
    with pytest.raises(DhtRecordError):
        v.validate(key, tampered)
    with pytest.raises(DhtRecordError):
        v.validate(key, b"\xff" * 10)
    assert v.select(key, [old, new, forged, tampered]) == 1
    assert decode_dht_record(key, new)[1] == ["/ip4/127.0.0.1/tcp/2"]


@pytest.mark.slow
def test_dht_finds_unconfigured_peers(tmp_path):
    with Swarm(tmp_path) as s:
        a = s.add("A", digest=False, dht=True)
        b = s.add("B", bootstrap=[a.addr], digest=False, dht=True)
        c = s.add("C", bootstrap=[a.addr], digest=False, dht=True)
        d = s.add("D", bootstrap=[a.addr], digest=False, dht=True)
        t0 = time.monotonic()

        def d_found_b_and_c():
            info = {p.peer: p for p in peers(d.addr).peers}
            return all(x.peer_id in info and "dht" in info[x.peer_id].sources for x in (b, c))

        wait_until(d_found_b_and_c, timeout_s=60, interval_s=1.0, what="D to find B and C in the DHT")
        info = {p.peer: p for p in peers(d.addr).peers}
        for x in (b, c):
            assert "bootstrap" not in info[x.peer_id].sources
        wait_until(lambda: all(p.up for p in peers(d.addr).peers), timeout_s=20,
                   what="D to connect to the peers it found")
        assert time.monotonic() - t0 < 80


def test_records_from_the_future_or_non_finite_are_refused():
    """A record with issued_at = inf/nan, or far ahead of our clock, would win select()
    over every record its owner publishes later: refused (SECURITY.md section 4)."""
    me = Identity.generate()
    key = f"/prefixmesh/{me.peer_id_b58}"
    now = 1_000_000.0
    for bad in (float("inf"), float("nan"), now + 3600.0):
        with pytest.raises(DhtRecordError):
            decode_dht_record(key, encode_dht_record(me, ["/ip4/127.0.0.1/tcp/1"], bad), now=now)
    ok = encode_dht_record(me, ["/ip4/127.0.0.1/tcp/1"], now + 60.0)  # small skew: fine
    assert decode_dht_record(key, ok, now=now)[2] == now + 60.0
    inf = encode_dht_record(me, ["/ip4/6.6.6.6/tcp/6"], float("inf"))
    later = encode_dht_record(me, ["/ip4/127.0.0.1/tcp/2"], time.time())
    assert PrefixmeshValidator().select(key, [inf, later]) == 1
