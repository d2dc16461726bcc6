"""Tests for overlay/core/antientropy.py: local refcounts, record streams, exchange, convergence."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixmesh.overlay.core import admission
from prefixmesh.overlay.core import antientropy as ae
from prefixmesh.overlay.core.antientropy import (
    AntiEntropy,
    OriginTableFull,
    TooManyDeltas,
    WrongModel,
)
from prefixmesh.overlay.core.digest import (
    KIND_DELTA,
    KIND_SNAPSHOT,
    MAX_HASHES_PER_RECORD,
    DigestError,
    DigestRecord,
    ExpiredRecord,
    LoadFigures,
    NamespaceDelta,
    ReplayedRecord,
    SequenceRegression,
    sign_record,
)
from prefixmesh.overlay.core.exchange import (
    decode_records,
    decode_reply,
    decode_summary,
    encode_records,
    encode_reply,
    encode_summary,
)
from prefixmesh.overlay.core.identity import Identity

MODEL = b"model-fingerprint"
NS = b"N" * 8
NS2 = b"M" * 8
T0 = 1_000_000.0
BIG = 1 << 24  # an exchange budget that never binds


def ident(i: int) -> Identity:
    return Identity.from_seed(i.to_bytes(32, "big"))


def node(i: int, now: float = T0, **kw) -> AntiEntropy:
    return AntiEntropy(ident(i), MODEL, epoch=kw.pop("epoch", 1), now=now, **kw)


def chain(tag: int, n: int) -> list[bytes]:
    """A fake chain: hash j of prefix `tag` -- shares blocks with other tags by design."""
    return [bytes([tag % 256]) + j.to_bytes(7, "big") for j in range(n)]


def shared_chain(n: int, fork_at: int, tag: int) -> list[bytes]:
    """n hashes whose first fork_at are common to every tag."""
    return [(b"\x00" if j < fork_at else bytes([tag])) + j.to_bytes(7, "big") for j in range(n)]


class Index:
    """Reference peer index fed by ReceiveResult.applied (what PeerCacheIndex does)."""

    def __init__(self):
        self.state: dict[bytes, dict[bytes, set[bytes]]] = {}

    def apply(self, records):
        for r in records:
            if r.kind == KIND_SNAPSHOT:
                self.state[r.origin] = {}
            per_ns = self.state.setdefault(r.origin, {})
            for d in r.namespaces:
                s = per_ns.setdefault(d.ns, set())
                s.update(d.added)
                s.difference_update(d.removed)

    def drop(self, origins):
        for o in origins:
            self.state.pop(o, None)

    def view(self, origin):
        return {ns: frozenset(s) for ns, s in self.state.get(origin, {}).items() if s}


def sync(a: AntiEntropy, b: AntiEntropy, now: float, budget=BIG, index_a=None, index_b=None):
    """One full, lossless 3-message exchange a -> b -> a -> b through the codecs."""
    m1 = encode_summary(a.summary())
    m2 = encode_reply(b.records_for(decode_summary(m1), budget), b.summary())
    reply = decode_reply(m2)
    ra = a.receive(reply.records, now)
    m3 = encode_records(a.records_for(reply.summary, budget, reply.want_snapshots))
    rb = b.receive(decode_records(m3), now)
    if index_a is not None:
        index_a.apply(ra.applied)
    if index_b is not None:
        index_b.apply(rb.applied)
    return ra, rb


# --- local refcounts and issued records ----------------------------------------------------


def test_initial_snapshot_and_summary():
    a = node(1)
    (snap,) = a.held_records(a.peer_id)
    assert snap.record.kind == KIND_SNAPSHOT and snap.record.seq == 0
    assert snap.record.epoch == 1 and snap.record.expires_at == T0 + 60
    assert a.summary() == {a.peer_id: (1, 0)}
    assert a.tick(T0 + 1) == []  # nothing changed, no refresh due


def test_refcounted_prefixes_share_blocks():
    a = node(1)
    p1 = shared_chain(6, 4, 1)
    p2 = shared_chain(8, 4, 2)
    a.local_add_prefix(NS, p1)
    a.local_add_prefix(NS, p2)
    assert a.local_hashes() == {NS: frozenset(p1) | frozenset(p2)}
    a.local_remove_prefix(NS, p1)
    # shared blocks remain while p2 holds them
    assert a.local_hashes() == {NS: frozenset(p2)}
    a.local_remove_prefix(NS, p2)
    assert a.local_hashes() == {}
    with pytest.raises(ValueError):
        a.local_remove_prefix(NS, p2)
    with pytest.raises(ValueError):
        a.local_add_prefix(b"short", p1)
    with pytest.raises(ValueError):
        a.local_add_prefix(NS, [b"x" * 7])


def test_remove_unknown_changes_nothing():
    a = node(1)
    a.local_add_prefix(NS, chain(1, 3))
    with pytest.raises(ValueError):
        a.local_remove_prefix(NS, chain(1, 3) + [b"z" * 8])
    assert a.local_hashes() == {NS: frozenset(chain(1, 3))}


def _grow_base(a: AntiEntropy, now: float, n: int = 200) -> float:
    """Give `a` a big snapshot so small changes go out as deltas, not compactions."""
    a.local_add_prefix(NS2, chain(9, n))
    recs = a.tick(now)
    assert recs[0].record.kind == KIND_SNAPSHOT
    return now


def test_delta_carries_adds_and_tombstones():
    a = node(1)
    _grow_base(a, T0 + 1)
    a.local_add_prefix(NS, chain(1, 4))
    (d1,) = a.tick(T0 + 2)
    assert d1.record.kind == KIND_DELTA
    assert d1.record.namespaces == (NamespaceDelta(NS, tuple(chain(1, 4)), ()),)
    a.local_remove_prefix(NS, chain(1, 4))
    a.local_add_prefix(NS, chain(2, 2))
    (d2,) = a.tick(T0 + 3)
    assert d2.record.seq == d1.record.seq + 1
    (nd,) = d2.record.namespaces
    assert set(nd.added) == set(chain(2, 2)) and set(nd.removed) == set(chain(1, 4))


def test_add_then_remove_before_tick_cancels():
    a = node(1)
    _grow_base(a, T0 + 1)
    a.local_add_prefix(NS, chain(1, 4))
    a.local_remove_prefix(NS, chain(1, 4))
    assert a.tick(T0 + 2) == []
    a.local_add_prefix(NS, chain(1, 4))
    a.tick(T0 + 3)
    a.local_remove_prefix(NS, chain(1, 4))
    a.local_add_prefix(NS, chain(1, 4))
    assert a.tick(T0 + 4) == []


def test_refresh_every_interval_keeps_node_alive():
    a = node(1, refresh_interval=20.0, ttl=60.0)
    _grow_base(a, T0)
    assert a.tick(T0 + 19.9) == []
    (r,) = a.tick(T0 + 20.0)
    assert r.record.kind == KIND_DELTA and r.record.namespaces == ()
    assert r.record.expires_at == T0 + 80.0
    a.set_local_load(LoadFigures(3, 2, 400.0, 90.0), 1 << 30, 1 << 20)
    (r2,) = a.tick(T0 + 40.0)
    assert r2.record.load == LoadFigures(3, 2, 400.0, 90.0)
    assert r2.record.kv_capacity_bytes == 1 << 30
    assert a.stats["refreshes_issued"] == 2


def test_compaction_garbage_collects_deltas_and_tombstones():
    a = node(1)
    _grow_base(a, T0, n=50)
    t = T0
    kinds = []
    for i in range(40):
        t += 1
        a.local_add_prefix(NS, chain(i, 3))
        a.local_remove_prefix(NS, chain(i, 3))  # cancels: nothing pending
        a.local_add_prefix(NS, chain(i + 100, 3))
        if i >= 1:
            a.local_remove_prefix(NS, chain(i + 99, 3))  # a tombstone each step
        kinds += [r.record.kind for r in a.tick(t)]
    assert KIND_SNAPSHOT in kinds  # compacted at least once
    held = a.held_records(a.peer_id)
    assert held[0].record.kind == KIND_SNAPSHOT
    tail = sum(len(s.raw) for s in held[1:])
    assert tail <= len(held[0].raw) + 400
    # the snapshot holds no tombstones and equals the advertised set after the deltas
    idx = Index()
    idx.apply(s.record for s in held)
    assert idx.view(a.peer_id) == a.local_hashes()


def test_snapshot_chain_for_large_sets():
    a = node(1)
    n = MAX_HASHES_PER_RECORD * 2 + 10
    a.local_add_prefix(NS, [i.to_bytes(8, "big") for i in range(n)])
    recs = a.tick(T0 + 1)
    assert [r.record.kind for r in recs] == [KIND_SNAPSHOT, KIND_DELTA, KIND_DELTA]
    assert [r.record.seq for r in recs] == [1, 2, 3]
    idx = Index()
    idx.apply(r.record for r in recs)
    assert idx.view(a.peer_id) == a.local_hashes()
    assert len(a.local_hashes()[NS]) == n


def test_advertised_hashes_are_capped(monkeypatch):
    monkeypatch.setattr(ae, "MAX_ADVERTISED_HASHES", 10)
    a = node(1)
    a.local_add_prefix(NS, chain(1, 8))
    a.local_add_prefix(NS, chain(2, 8))
    assert len(a.local_hashes()[NS]) == 10
    assert a.stats["unadvertised_hashes"] == 6
    # the first prefix is fully advertised, the second root-first
    assert set(chain(1, 8)) <= a.local_hashes()[NS]
    a.local_remove_prefix(NS, chain(1, 8))
    a.tick(T0 + 1)
    # space freed: the next snapshot advertises the overflow
    a._force_snapshot = True
    a.tick(T0 + 2)
    assert a.local_hashes()[NS] == frozenset(chain(2, 8))


# --- two-node exchange ------------------------------------------------------------------------


def test_exchange_converges_and_is_idempotent():
    a, b = node(1), node(2)
    a.local_add_prefix(NS, chain(1, 5))
    a.tick(T0 + 1)
    ia, ib = Index(), Index()
    ra, rb = sync(a, b, T0 + 2, index_a=ia, index_b=ib)
    assert ib.view(a.peer_id) == a.local_hashes()
    assert b.peer_id in ia.state and ia.view(b.peer_id) == {}
    assert a.summary() == b.summary()
    # again: nothing to send either way
    assert a.records_for(b.summary(), BIG) == [] and b.records_for(a.summary(), BIG) == []
    # duplicates are ignored silently
    again = b.receive([s.raw for s in a.held_records(a.peer_id)], T0 + 3)
    assert again.applied == [] and again.rejected == [] and again.duplicates >= 1
    assert b.stats["duplicates"] >= 1


def test_duplicates_within_one_batch_are_silent():
    a, b = node(1), node(2)
    a.local_add_prefix(NS, chain(1, 5))
    a.tick(T0 + 1)
    raws = [s.raw for s in a.held_records(a.peer_id)]
    res = b.receive(raws + raws, T0 + 2)
    assert res.rejected == [] and len(res.applied) == len(raws)
    assert res.duplicates == len(raws)


def test_relayed_records_are_byte_identical():
    a, b, c = node(1), node(2), node(3)
    a.local_add_prefix(NS, chain(1, 5))
    a.tick(T0 + 1)
    sync(b, a, T0 + 2)
    ic = Index()
    sync(c, b, T0 + 3, index_a=ic)  # c learns a's records only through b
    assert [s.raw for s in c.held_records(a.peer_id)] == [s.raw for s in a.held_records(a.peer_id)]
    assert ic.view(a.peer_id) == a.local_hashes()


def test_deltas_only_when_peer_is_recent():
    a, b = node(1), node(2)
    _grow_base(a, T0 + 1)
    sync(b, a, T0 + 2)
    a.local_add_prefix(NS, chain(1, 3))
    (delta,) = a.tick(T0 + 3)
    sent = a.records_for(b.summary(), BIG)
    assert [s.raw for s in sent] == [delta.raw]
    # a peer that never heard of a gets the snapshot and the deltas after it
    fresh = node(3)
    sent = a.records_for(fresh.summary(), BIG)
    assert [s.record.kind for s in sent if s.record.origin == a.peer_id] == [
        KIND_SNAPSHOT,
        KIND_DELTA,
    ]
    # a snapshot request forces the snapshot even for a recent peer
    sent = a.records_for(b.summary(), BIG, want_snapshots=[a.peer_id])
    assert sent[0].record.kind == KIND_SNAPSHOT


def test_gap_reports_need_snapshot():
    a, b = node(1), node(2)
    _grow_base(a, T0 + 1)
    sync(b, a, T0 + 2)
    a.local_add_prefix(NS, chain(1, 3))
    (d1,) = a.tick(T0 + 3)
    a.local_add_prefix(NS, chain(2, 3))
    (d2,) = a.tick(T0 + 4)
    res = b.receive([d2.raw], T0 + 5)  # d1 lost
    assert res.applied == [] and res.need_snapshot == {a.peer_id}
    assert b.summary()[a.peer_id] == (1, d1.record.seq - 1)
    # a delta of an unknown origin is a gap too
    c = node(3)
    assert c.receive([d1.raw], T0 + 5).need_snapshot == {a.peer_id}
    # the next exchange repairs it
    ib = Index()
    ib.apply(s.record for s in b.held_records(a.peer_id))
    sync(b, a, T0 + 6, index_a=ib)
    assert ib.view(a.peer_id) == a.local_hashes()


def test_new_epoch_replaces_and_old_epoch_regresses():
    a1 = node(1, epoch=1)
    a1.local_add_prefix(NS, chain(1, 3))
    a1.tick(T0 + 1)
    b = node(2)
    sync(b, a1, T0 + 2)
    a2 = node(1, now=T0 + 3, epoch=2)  # restart: new epoch, empty cache
    a2.local_add_prefix(NS, chain(7, 2))
    a2.tick(T0 + 4)
    ib = Index()
    sync(b, a2, T0 + 5, index_a=ib)
    assert b.summary()[a2.peer_id][0] == 2
    assert ib.view(a2.peer_id) == a2.local_hashes()
    # a record of the old epoch is now a regression
    a1.local_add_prefix(NS, chain(3, 3))
    (old,) = a1.tick(T0 + 6)
    res = b.receive([old.raw], T0 + 7)
    assert [type(e) for e in res.rejected] == [SequenceRegression]
    # a delta of a newer epoch without its snapshot is a gap
    a3 = node(1, now=T0 + 8, epoch=3)
    a3.local_add_prefix(NS, chain(4, 200))
    a3.tick(T0 + 8)
    a3.local_add_prefix(NS, chain(5, 1))
    (d,) = a3.tick(T0 + 9)
    assert d.record.kind == KIND_DELTA
    assert b.receive([d.raw], T0 + 9).need_snapshot == {a3.peer_id}


def _record(identity, **kw):
    fields = dict(
        origin=identity.peer_id,
        epoch=1,
        seq=1,
        issued_at=T0,
        expires_at=T0 + 60,
        model=MODEL,
        kind=KIND_DELTA,
        namespaces=(),
        load=LoadFigures(),
        kv_capacity_bytes=0,
        kv_used_bytes=0,
    )
    fields.update(kw)
    return sign_record(DigestRecord(**fields), identity)


def test_equivocation_is_replayed_record_and_stale_is_regression():
    a, b = node(1), node(2)
    _grow_base(a, T0 + 1)
    a.local_add_prefix(NS, chain(1, 3))
    (d,) = a.tick(T0 + 2)
    sync(b, a, T0 + 3)
    # same (epoch, seq), different content, validly signed by the origin
    evil = _record(ident(1), seq=d.record.seq, namespaces=(NamespaceDelta(NS, (b"e" * 8,)),))
    res = b.receive([evil.raw], T0 + 4)
    assert [type(e) for e in res.rejected] == [ReplayedRecord]
    # a record older than the held snapshot
    stale = _record(ident(1), seq=0, kind=KIND_SNAPSHOT)
    res = b.receive([stale.raw], T0 + 4)
    assert [type(e) for e in res.rejected] == [SequenceRegression]
    assert b.stats["rejected"]["ReplayedRecord"] == 1
    assert b.stats["rejected"]["SequenceRegression"] == 1


def test_wrong_model_rejected_and_counted():
    a = AntiEntropy(ident(1), b"other-model", epoch=1, now=T0)
    b = node(2)
    res = b.receive([s.raw for s in a.held_records(a.peer_id)], T0 + 1)
    assert [type(e) for e in res.rejected] == [WrongModel]
    assert b.stats["rejected"]["WrongModel"] == 1
    assert a.peer_id not in b.summary()


def test_bad_bytes_rejected_with_digest_errors():
    b = node(2)
    good = node(1).held_records(ident(1).peer_id)[0].raw
    bad = bytearray(good)
    bad[-1] ^= 1
    res = b.receive([b"junk", bytes(bad), good], T0 + 1)
    assert len(res.rejected) == 2 and all(isinstance(e, DigestError) for e in res.rejected)
    assert len(res.applied) == 1
    assert sum(b.stats["rejected"].values()) == 2


def test_expired_records_and_expire():
    a, b = node(1, ttl=60.0, refresh_interval=20.0), node(2)
    a.local_add_prefix(NS, chain(1, 300))
    a.tick(T0 + 1)
    snapshot_raws = [s.raw for s in a.held_records(a.peer_id)]
    # alone and expired: refused
    res = b.receive(snapshot_raws, T0 + 100)
    assert res.applied == [] and {type(e) for e in res.rejected} == {ExpiredRecord}
    # refreshes keep a alive; the old snapshot travels with a fresh refresh and is accepted
    t = T0 + 1
    while t < T0 + 100:
        t += 20
        a.tick(t)
    held = a.held_records(a.peer_id)
    assert held[0].record.expires_at < t  # the snapshot itself expired long ago
    ib = Index()
    res = b.receive([s.raw for s in held], t)
    ib.apply(res.applied)
    assert res.rejected == [] and ib.view(a.peer_id) == a.local_hashes()
    # without further refreshes, a expires at b
    assert b.expire(t + 59) == []
    assert b.expire(t + 60) == [a.peer_id]
    assert a.peer_id not in b.summary() and b.stats["origins_expired"] == 1
    assert b.held_bytes() == sum(len(s.raw) for s in b.held_records(b.peer_id))


def test_origin_table_is_bounded_and_admits_by_merit(monkeypatch):
    """A full table evicts its least valuable origin (equal merit: the oldest) instead of
    refusing newcomers; origins seen up are never displaced by never-seen-up ones."""
    monkeypatch.setattr(ae, "MAX_ORIGINS", 3)
    relay = node(100)
    raws = [node(i).held_records(ident(i).peer_id)[0].raw for i in range(8)]
    res = relay.receive(raws[:5], T0 + 1)
    assert len(res.applied) == 5 and res.rejected == []
    held = {o for o in relay.origins() if o != relay.peer_id}
    assert held == {ident(i).peer_id for i in (2, 3, 4)}  # the two oldest gave way
    assert relay.stats["origins_evicted"] == 2
    up = {ident(i).peer_id for i in (2, 3, 4)}
    relay.origin_merit = lambda o: admission.SEEN_UP if o in up else admission.NEVER_UP
    res = relay.receive(raws[5:], T0 + 2)
    assert res.applied == [] and {type(e) for e in res.rejected} == {OriginTableFull}
    assert {o for o in relay.origins() if o != relay.peer_id} == up
    up.discard(ident(2).peer_id)  # no longer valued: a newcomer may displace it
    res = relay.receive(raws[5:6], T0 + 3)
    assert [r.origin for r in res.applied] == [ident(5).peer_id]
    assert ident(2).peer_id not in relay.origins()


def test_new_origins_from_strangers_cost_more():
    raws = [node(i).held_records(ident(i).peer_id)[0].raw for i in range(200)]
    relay = node(1000)
    relay.sender_known = lambda peer: peer == b"known"
    res = relay.receive(raws, T0 + 1, sender=b"stranger")
    per_stranger = int(ae.NEW_ORIGIN_BURST / ae.STRANGER_ORIGIN_COST)
    assert len(res.applied) == per_stranger
    assert {type(e) for e in res.rejected} == {ae.NewOriginBudget}
    # the strangers' spending leaves the known peers' budget whole
    res = relay.receive(raws, T0 + 1, sender=b"known")
    assert len(res.applied) == 200 - per_stranger and res.rejected == []
    # refill: strangers get NEW_ORIGIN_TOKENS_PER_S / STRANGER_ORIGIN_COST origins a second
    more = [node(i).held_records(ident(i).peer_id)[0].raw for i in range(200, 230)]
    res = relay.receive(more, T0 + 11, sender=b"stranger")
    assert len(res.applied) == int(10 * ae.NEW_ORIGIN_TOKENS_PER_S / ae.STRANGER_ORIGIN_COST)


def _addr_node(i: int, subnet: int) -> AntiEntropy:
    return node(i, addrs=(f"/ip4/10.0.{subnet}.{i % 250 + 1}/tcp/4001",))


def test_origins_per_subnet_are_capped(monkeypatch):
    monkeypatch.setattr(ae, "MAX_ORIGINS_PER_SUBNET", 4)
    relay = node(1000)
    crowd = [_addr_node(i, 7).held_records(ident(i).peer_id)[0].raw for i in range(10)]
    other = [_addr_node(i, 8).held_records(ident(i).peer_id)[0].raw for i in range(10, 13)]
    res = relay.receive(crowd, T0 + 1)  # equal merit: newcomers displace the oldest
    assert len(res.applied) == 10 and relay._merits.per_subnet["10.0.7.0/24"] == 4
    up = set(relay.origins())
    relay.origin_merit = lambda o: admission.SEEN_UP if o in up else admission.NEVER_UP
    fresh = [_addr_node(i, 7).held_records(ident(i).peer_id)[0].raw for i in range(20, 25)]
    res = relay.receive(fresh, T0 + 2)
    assert res.applied == [] and {type(e) for e in res.rejected} == {ae.OriginSubnetFull}
    res = relay.receive(other, T0 + 2)
    assert len(res.applied) == 3 and res.rejected == []  # another block has room


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=1, max_size=40))
def test_admission_invariants(steps):
    """For any arrival order of origins (subnet, seen-up): the table never exceeds its
    bounds, and a seen-up origin is never displaced by a never-seen-up newcomer."""
    saved = ae.MAX_ORIGINS, ae.MAX_ORIGINS_PER_SUBNET
    ae.MAX_ORIGINS, ae.MAX_ORIGINS_PER_SUBNET = 6, 3
    try:
        relay = node(1000)
        up: set[bytes] = set()
        relay.origin_merit = lambda o: admission.SEEN_UP if o in up else admission.NEVER_UP
        t = T0
        for i, (subnet, is_up) in enumerate(steps):
            t += 1
            origin = ident(2000 + i).peer_id
            before = set(relay.origins())
            raw = _addr_node(2000 + i, subnet).held_records(origin)[0].raw
            if is_up:
                up.add(origin)
            res = relay.receive([raw], t)
            after = set(relay.origins())
            held = after - {relay.peer_id}
            assert len(held) <= ae.MAX_ORIGINS
            assert max(relay._merits.per_subnet.values(), default=0) <= ae.MAX_ORIGINS_PER_SUBNET
            if not is_up:
                assert before & up <= after  # nothing valued went for a hint
            assert (origin in after) == bool(res.applied)
    finally:
        ae.MAX_ORIGINS, ae.MAX_ORIGINS_PER_SUBNET = saved


def test_deltas_per_origin_are_bounded(monkeypatch):
    a = node(1)
    _grow_base(a, T0, n=2000)
    deltas = []
    for i in range(6):
        a.local_add_prefix(NS, chain(i, 1))
        deltas += a.tick(T0 + 1 + i)
    assert all(d.record.kind == KIND_DELTA for d in deltas)
    relay = node(2)
    monkeypatch.setattr(ae, "MAX_DELTAS_PER_ORIGIN", 4)
    res = relay.receive([s.raw for s in a.held_records(a.peer_id)], T0 + 10)
    # the 5th delta is refused; the 6th then no longer follows the held ones: a gap
    assert [type(e) for e in res.rejected] == [TooManyDeltas]
    assert res.need_snapshot == {a.peer_id}
    assert len(relay.held_records(a.peer_id)) == 1 + 4
    # an origin snapshot later resets the log
    a._force_snapshot = True
    a.tick(T0 + 20)
    monkeypatch.setattr(ae, "MAX_DELTAS_PER_ORIGIN", 256)
    sync(relay, a, T0 + 21)
    assert relay.summary()[a.peer_id] == a.summary()[a.peer_id]


def test_budget_is_shared_fairly_and_prefixes_are_gap_free():
    origins = [node(i) for i in range(1, 7)]
    for i, o in enumerate(origins):
        o.local_add_prefix(NS, chain(i, 100 + 100 * i))  # different snapshot sizes
        o.tick(T0 + 1)
    relay = node(50)
    for o in origins:
        sync(relay, o, T0 + 2)
    fresh = node(60)
    smallest = min(len(o.held_records(o.peer_id)[0].raw) for o in origins)
    budget = 4 * smallest
    sent = relay.records_for(fresh.summary(), budget)
    assert sum(len(s.raw) for s in sent) <= budget
    # several small origins rather than one big one, smallest first
    assert {s.record.origin for s in sent} == {
        relay.peer_id,
        origins[0].peer_id,
        origins[1].peer_id,
    }
    res = fresh.receive([s.raw for s in sent], T0 + 3)
    assert res.rejected == [] and not res.need_snapshot
    # repeated small-budget exchanges complete everything
    for _ in range(40):
        res = fresh.receive([s.raw for s in relay.records_for(fresh.summary(), 8000)], T0 + 3)
        assert not res.need_snapshot
    assert fresh.summary() == {**relay.summary(), fresh.peer_id: fresh.summary()[fresh.peer_id]}


def test_own_epoch_bump_when_peer_holds_newer_own_record():
    a_old = node(1, epoch=5)
    for i in range(3):
        a_old.local_add_prefix(NS, chain(10 + i, 2))
        a_old.tick(T0 + 0.1 * i)
    assert a_old.summary()[a_old.peer_id][1] >= 2
    b = node(2)
    sync(b, a_old, T0 + 1)
    a_new = node(1, now=T0 + 2, epoch=5)  # restarted but reused its epoch
    a_new.local_add_prefix(NS, chain(1, 2))
    a_new.tick(T0 + 2)
    sync(a_new, b, T0 + 3)
    assert a_new.stats["own_epoch_bumps"] == 1
    recs = a_new.tick(T0 + 4)
    assert recs[0].record.kind == KIND_SNAPSHOT and recs[0].record.epoch == 6
    ib = Index()
    sync(b, a_new, T0 + 5, index_a=ib)
    assert b.summary()[a_new.peer_id] == (6, 0)
    assert ib.view(a_new.peer_id) == a_new.local_hashes()


# --- model-based: a relay chain tracks the origin exactly ----------------------------------------

ops = st.lists(
    st.tuples(st.sampled_from(["add", "remove", "tick", "sync", "lose"]), st.integers(0, 7)),
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_relay_chain_tracks_origin(program):
    origin, relay, leaf = node(1), node(2), node(3)
    i_relay, i_leaf = Index(), Index()
    held: list[tuple[bytes, list[bytes]]] = []
    t = T0
    for op, arg in program:
        t += 1
        if op == "add":
            c = shared_chain(3 + arg, 2, arg)
            origin.local_add_prefix(NS if arg % 2 else NS2, c)
            held.append((NS if arg % 2 else NS2, c))
        elif op == "remove" and held:
            ns, c = held.pop(arg % len(held))
            origin.local_remove_prefix(ns, c)
        elif op == "tick":
            origin.tick(t)
        elif op == "sync":
            sync(relay, origin, t, index_a=i_relay)
            sync(leaf, relay, t, index_a=i_leaf)
        elif op == "lose":
            # the relay gets only the newest own record of origin: a gap unless in sequence
            recs = origin.held_records(origin.peer_id)
            i_relay.apply(relay.receive([recs[-1].raw], t).applied)
    t += 1
    origin.tick(t)
    sync(relay, origin, t, index_a=i_relay)
    sync(leaf, relay, t, index_a=i_leaf)
    assert i_relay.view(origin.peer_id) == origin.local_hashes()
    assert i_leaf.view(origin.peer_id) == origin.local_hashes()


# --- convergence of 64 peers with lossy delivery ----------------------------------------------


class Sim:
    def __init__(self, n: int, seed: int, loss: float, fanout: int):
        self.rng = random.Random(seed)
        self.loss = loss
        self.fanout = fanout
        self.t = T0
        self.nodes = [
            node(1000 * seed + i, now=T0, ttl=600.0, refresh_interval=60.0) for i in range(n)
        ]
        self.index = [Index() for _ in range(n)]
        self.messages = 0
        self.dropped = 0

    def _deliver(self) -> bool:
        self.messages += 1
        if self.rng.random() < self.loss:
            self.dropped += 1
            return False
        return True

    def exchange(self, i: int, j: int) -> None:
        a, b = self.nodes[i], self.nodes[j]
        if not self._deliver():
            return
        m2 = encode_reply(
            b.records_for(decode_summary(encode_summary(a.summary())), BIG), b.summary()
        )
        if not self._deliver():
            return
        reply = decode_reply(m2)
        self.index[i].apply(a.receive(reply.records, self.t).applied)
        m3 = encode_records(a.records_for(reply.summary, BIG, reply.want_snapshots))
        if not self._deliver():
            return
        self.index[j].apply(b.receive(decode_records(m3), self.t).applied)

    def round(self) -> None:
        self.t += 1.0
        for n in self.nodes:
            n.tick(self.t)
        order = list(range(len(self.nodes)))
        self.rng.shuffle(order)
        for i in order:
            others = [j for j in range(len(self.nodes)) if j != i]
            for j in self.rng.sample(others, self.fanout):
                self.exchange(i, j)

    def converged(self) -> bool:
        truth = {n.peer_id: n.local_hashes() for n in self.nodes}
        for k, idx in enumerate(self.index):
            for o, hashes in truth.items():
                if o != self.nodes[k].peer_id and idx.view(o) != hashes:
                    return False
        return True


@pytest.mark.parametrize("fanout", [1, 2, 3])
def test_convergence_of_64_lossy_peers_is_logarithmic(fanout):
    n, loss = 64, 0.2
    # push-pull gossip reaches everyone in O(log N) rounds; measured worst over 8 seeds
    # (bench): fanout 1: 11, 2: 5, 3: 3 rounds, against 2 ln(65)/fanout = 8.3, 4.2, 2.8
    bound = 2 * math.log(n + 1) / fanout + 4
    worst = 0
    for seed in range(1, 3):  # (each seed costs seconds; the bound is the bench's, 8 seeds)
        sim = Sim(n, seed, loss, fanout)
        # warm-up: everyone learns everyone's (distinct, partly shared) cache
        for k, nd in enumerate(sim.nodes):
            nd.local_add_prefix(NS, shared_chain(4 + k % 5, 2, k))
        for _ in range(60):
            sim.round()
            if sim.converged():
                break
        assert sim.converged()
        # a new prefix at one node spreads to all in O(log N) rounds
        new = shared_chain(6, 0, 200)
        sim.nodes[0].local_add_prefix(NS2, new)
        rounds = 0
        while True:
            sim.round()
            rounds += 1
            if all(
                sim.index[k].view(sim.nodes[0].peer_id).get(NS2) == frozenset(new)
                for k in range(1, n)
            ):
                break
            assert rounds <= 50
        worst = max(worst, rounds)
        assert rounds <= bound, (seed, fanout, rounds, bound)
        # removals (and adds elsewhere) converge too, to the true sets
        rng = random.Random(seed)
        for k in rng.sample(range(n), 8):
            sim.nodes[k].local_remove_prefix(NS, shared_chain(4 + k % 5, 2, k))
        sim.nodes[0].local_remove_prefix(NS2, new)
        sim.nodes[5].local_add_prefix(NS2, shared_chain(3, 0, 201))
        for _ in range(int(bound) + 10):
            sim.round()
            if sim.converged():
                break
        assert sim.converged()
        assert sim.dropped > 0.1 * sim.messages
