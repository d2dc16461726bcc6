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


# --- DHT upkeep: announce when something changed, look up less while nothing is new ------


class _Dht:
    """Stands in for py-libp2p's KadDHT: counts the calls the upkeep makes and answers
    lookups with the providers a test puts in."""

    def __init__(self):
        self.table = 1
        self.provides = self.puts = self.lookups = 0
        self.providers: list = []
        self.provide_ok = True

    async def add_peer(self, _peer):
        pass

    def get_routing_table_size(self):
        return self.table

    async def provide(self, _key):
        self.provides += 1
        return self.provide_ok

    async def put_value(self, _key, _value):
        self.puts += 1

    async def find_providers(self, _key, _count):
        self.lookups += 1
        return list(self.providers)


class _Host:
    def __init__(self):
        self.identity = Identity.generate()
        self.peer_id = self.identity.peer_id
        self.addrs = ["/ip4/127.0.0.1/tcp/4001"]

    def listen_addrs(self):
        return list(self.addrs)


class _Directory:
    def __init__(self):
        self.known: set[bytes] = set()

    def learn(self, peer, addrs, source):
        new = peer not in self.known
        self.known.add(peer)
        return new


class _Info:
    def __init__(self, peer: bytes):
        from libp2p.peer.id import ID

        self.peer_id = ID(peer)
        self.addrs = ["/ip4/127.0.0.1/tcp/4002"]


def test_dht_upkeep_announces_on_change_and_backs_off_lookups():
    import trio

    from prefixmesh.overlay import discovery as disc

    async def main():
        host, dht, directory = _Host(), _Dht(), _Directory()
        d = disc.DhtDiscovery(host, directory, b"\x01" * 32, interval_s=10.0,
                              connected=lambda: [])
        d.dht = dht
        clock = trio.lowlevel.current_clock()

        async def round_at(t: float) -> None:
            clock.jump(t - trio.current_time())
            await d._round(None)

        await round_at(0.0)  # first round: announce (2 keys + the address record), look up
        assert (dht.provides, dht.puts, d.announces, dht.lookups) == (2, 1, 1, 2)
        for t in range(10, 120, 10):  # a new node announces and looks up every round
            await round_at(float(t))
        assert d.finds == 12 and d.announces == 12
        for t in range(120, 521, 10):
            await round_at(float(t))
        # then, nothing changed: no announce; lookups find nobody new, so they back off:
        # at 120, 130, 150, 190, 270, 390 and 510 s (10 -> 20 -> 40 -> 80 -> 120 s apart)
        assert d.announces == 12 and dht.provides == 24
        assert d.finds == 12 + 7, d.finds
        dht.table = 2  # the routing table doubled: peers closer to our keys may have come
        await round_at(521.0)
        assert d.announces == 13
        host.addrs.append("/ip4/10.0.0.1/tcp/4001/p2p-circuit")  # a new address
        await round_at(522.0)
        assert d.announces == 14
        await round_at(522.0 + disc.REANNOUNCE_S)  # and a refresh long before records expire
        assert d.announces == 15
        dht.provide_ok = False  # an announce that reached nobody is tried again next round
        host.addrs.append("/ip4/10.0.0.2/tcp/4001")
        await round_at(3000.0)
        await round_at(3010.0)
        assert d.announces == 17
        dht.provide_ok = True
        await round_at(3020.0)
        await round_at(3030.0)
        assert d.announces == 18
        # a lookup that finds someone new resets the back-off: look again next round
        dht.providers = [_Info(Identity.generate().peer_id)]
        finds = d.finds
        await round_at(5000.0)
        assert d.finds == finds + 1 and d.found == 1
        await round_at(5000.5)  # looked again: the same provider, nothing new
        assert d.finds == finds + 2 and d.found == 1
        await round_at(5001.0)  # so back off: the next lookup after interval_s
        assert d.finds == finds + 2
        await round_at(5010.5)
        assert d.finds == finds + 3

    trio.run(main, clock=trio.testing.MockClock())
