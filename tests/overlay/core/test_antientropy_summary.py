"""Tests for the incremental summary (cached encodings, records_for, bucket hashes), delta
batching and bucketed exchanges of overlay/core/antientropy.py and overlay/core/exchange.py
(issue 6, T7 and simulator speed)."""

from __future__ import annotations

import math
import random
from collections import deque

import cbor2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixmesh.overlay.core import exchange as ex
from prefixmesh.overlay.core.antientropy import AntiEntropy
from prefixmesh.overlay.core.exchange import (
    AntiEntropyError,
    decode_records,
    decode_reply,
    decode_summary,
    encode_records,
    encode_reply,
    encode_summary,
    summary_hash,
)
from prefixmesh.overlay.core.identity import Identity

MODEL = b"model-fingerprint"
NS = b"N" * 8
NS2 = b"M" * 8
T0 = 1_000_000.0
BIG = 1 << 24


def ident(i: int) -> Identity:
    return Identity.from_seed(i.to_bytes(32, "big"))


def node(i: int, now: float = T0, **kw) -> AntiEntropy:
    return AntiEntropy(ident(i), MODEL, epoch=kw.pop("epoch", 1), now=now, **kw)


def shared_chain(n: int, fork_at: int, tag: int) -> list[bytes]:
    return [(b"\x00" if j < fork_at else bytes([tag])) + j.to_bytes(7, "big") for j in range(n)]


def full_sync(a: AntiEntropy, b: AntiEntropy, now: float) -> None:
    m2 = encode_reply(b.records_for(decode_summary(encode_summary(a.summary())), BIG), b.summary())
    reply = decode_reply(m2)
    a.receive(reply.records, now)
    b.receive(decode_records(encode_records(a.records_for(reply.summary, BIG))), now)


# --- cached encodings equal the reference codecs ---------------------------------------------


def reference_bucket_hashes(summary, k):
    import hashlib

    out = [0] * k
    for o, v in summary.items():
        h = hashlib.blake2b(cbor2.dumps([o, *v], canonical=True), digest_size=4).digest()
        out[ex.bucket_of(o, k)] ^= int.from_bytes(h, "big")
    return out


ops = st.lists(
    st.tuples(st.sampled_from(["add", "remove", "tick", "sync", "expire"]), st.integers(0, 9)),
    max_size=30,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_cached_summary_encodings_equal_the_codecs(program):
    nodes = [node(i, ttl=30.0, refresh_interval=10.0) for i in range(4)]
    held: list[tuple[int, list[bytes]]] = []
    t = T0
    for op, arg in program:
        t += 3
        k = arg % 4
        if op == "add":
            c = shared_chain(2 + arg, 1, arg)
            nodes[k].local_add_prefix(NS, c)
            held.append((k, c))
        elif op == "remove" and held:
            k, c = held.pop(arg % len(held))
            nodes[k].local_remove_prefix(NS, c)
        elif op == "tick":
            nodes[k].tick(t)
        elif op == "sync":
            full_sync(nodes[k], nodes[(k + 1 + arg % 3) % 4], t)
        else:
            nodes[k].expire(t + 40)
        for n in nodes:
            s = n.summary()
            assert s == {o: (log.epoch, log.last_seq) for o, log in n._logs.items()}
            assert n.encoded_summary() == encode_summary(s)
            assert n.summary_digest() == summary_hash(s)
            recs = n.held_records(n.peer_id)[-2:]
            want = [nodes[0].peer_id]
            assert n.encode_reply(recs, want) == encode_reply(recs, s, want)
            for k in (1, 4):  # cached bucket hashes, kept current incrementally
                assert n.bucket_hashes(k) == reference_bucket_hashes(s, k)


# --- records_for is unchanged: reference implementation (the pre-issue-6 code) -------------


def reference_records_for(a: AntiEntropy, peer_summary, budget_bytes, want_snapshots=()):
    want = set(want_snapshots)
    queues = []
    for origin, log in a._logs.items():
        theirs = peer_summary.get(origin)
        if theirs is None or origin in want or theirs[0] < log.epoch:
            needed = log.records
        elif theirs[0] > log.epoch or theirs[1] >= log.last_seq:
            continue
        elif theirs[1] < log.first_seq:
            needed = log.records
        else:
            needed = log.after(theirs[1])
        if needed:
            n_bytes = sum(len(s.raw) for s in needed)
            queues.append((n_bytes, -needed[-1].record.issued_at, origin, deque(needed)))
    queues.sort(key=lambda q: q[:3])
    out, remaining, active = [], budget_bytes, [q[3] for q in queues]
    while active:
        still = []
        for queue in active:
            size = len(queue[0].raw)
            if size > remaining:
                continue
            out.append(queue.popleft())
            remaining -= size
            if queue:
                still.append(queue)
        active = still
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(1, 30)), max_size=12),
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.integers(0, 12)), max_size=8),
    st.integers(0, 6000),
    st.lists(st.integers(0, 5), max_size=3),
)
def test_records_for_matches_the_reference(adds, peer_entries, budget, wants):
    nodes = [node(i) for i in range(6)]
    t = T0
    for k, n_blocks in adds:
        t += 1
        nodes[k].local_add_prefix(NS, shared_chain(n_blocks, 0, n_blocks + k))
        nodes[k].tick(t)
    hub = nodes[0]
    for n in nodes[1:]:
        hub.receive([s.raw for s in n.held_records(n.peer_id)], t)
    pids = [n.peer_id for n in nodes]
    peer = {pids[k]: (e, s) for k, e, s in peer_entries}
    want = [pids[k] for k in wants]
    got = hub.records_for(peer, budget, want)
    assert [r.raw for r in got] == [r.raw for r in reference_records_for(hub, peer, budget, want)]


# --- per-peer delta summaries ----------------------------------------------------------------


def test_min_record_interval_batches_changes_into_one_delta():
    a = node(1, min_record_interval=5.0)
    t = T0
    a.local_add_prefix(NS, shared_chain(3, 0, 1))
    first = a.tick(t + 0.5)  # the snapshot at T0 was the last record: wait
    assert first == []
    assert len(a.tick(t + 5.0)) == 1  # first change after a quiet period
    a.local_add_prefix(NS, shared_chain(3, 0, 2))
    assert a.tick(t + 6.0) == []
    a.local_add_prefix(NS, shared_chain(3, 0, 3))
    assert a.tick(t + 9.0) == []
    batch = a.tick(t + 10.0)
    assert len(batch) == 1
    added = {h for d in batch[0].record.namespaces for h in d.added}
    # one record with both changes (a delta, or a compaction snapshot of everything held)
    assert added >= set(shared_chain(3, 0, 2)) | set(shared_chain(3, 0, 3))
    assert added <= set(a.local_hashes()[NS])
    # refreshes are unaffected by the knob
    assert a.tick(t + 29.0) == [] and len(a.tick(t + 30.0)) == 1
    for bad in (-1.0, 20.0):
        with pytest.raises(ValueError):
            node(2, min_record_interval=bad)


# --- bucketed summaries -------------------------------------------------------------------------


def bucket_exchange(a: AntiEntropy, b: AntiEntropy, now: float) -> bool:
    """a opens, b answers with bucket hashes, a sends the differing buckets' entries, b
    replies with records + its entries there, a sends records: through the codecs."""
    from prefixmesh.overlay.core.exchange import (
        ScopedSummary,
        bucket_count,
        decode_buckets,
        decode_scoped_summary,
        encode_buckets,
        encode_scoped_summary,
    )

    theirs = decode_buckets(encode_buckets(b.bucket_hashes(bucket_count(b.summary_size()))))
    k = len(theirs)
    ours = a.bucket_hashes(k)
    differ = tuple(i for i in range(k) if ours[i] != theirs[i])
    if not differ:
        return False
    sc = decode_scoped_summary(
        encode_scoped_summary(ScopedSummary(k, differ, a.scoped_summary(k, differ)))
    )
    scope = (sc.k, sc.buckets)
    reply = decode_reply(
        encode_reply(b.records_for(sc.entries, BIG, scope=scope), b.scoped_summary(k, differ))
    )
    a.receive(reply.records, now)
    b.receive([r.raw for r in a.records_for(reply.summary, BIG, scope=scope)], now)
    return True


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.integers(0, 9), st.integers(1, 12)), max_size=15),
    st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), max_size=15),
)
def test_a_bucket_exchange_moves_exactly_what_a_full_exchange_moves(adds, syncs):
    def world():
        return [node(i) for i in range(10)]

    worlds = [world(), world()]
    for w in worlds:
        t = T0
        for k, n_blocks in adds:
            t += 1
            w[k].local_add_prefix(NS, shared_chain(n_blocks, 1, n_blocks * 10 + k))
            w[k].tick(t)
        for i, j in syncs:  # same partial spread in both worlds
            if i != j:
                full_sync(w[i], w[j], t)
    full, buck = worlds
    for i, j in [(0, 1), (2, 3), (4, 9), (1, 0)]:
        full_sync(full[i], full[j], T0 + 100)
        bucket_exchange(buck[i], buck[j], T0 + 100)
    for f, b in zip(full, buck, strict=True):
        assert f.summary() == b.summary()


def test_bucket_hashes_track_the_summary_and_codecs_reject_garbage():
    from prefixmesh.overlay.core.exchange import (
        ScopedSummary,
        bucket_count,
        bucket_of,
        decode_buckets,
        decode_scoped_summary,
        encode_buckets,
        encode_scoped_summary,
    )

    assert [bucket_count(n) for n in (0, 1, 2, 3, 64, 65, 10**6)] == [1, 1, 2, 4, 64, 128, 4096]
    a, b = node(1), node(2)
    assert a.bucket_hashes(8) != b.bucket_hashes(8)
    full_sync(a, b, T0)
    assert a.bucket_hashes(8) == b.bucket_hashes(8) and a.bucket_hashes(1) == b.bucket_hashes(1)
    before = a.bucket_hashes(8)
    a.local_add_prefix(NS, shared_chain(3, 0, 5))
    a.tick(T0 + 1)
    after = a.bucket_hashes(8)
    changed = [i for i in range(8) if before[i] != after[i]]
    assert changed == [bucket_of(a.peer_id, 8)]
    assert a.scoped_summary(8, changed) == {a.peer_id: a.summary()[a.peer_id]}
    with pytest.raises(ValueError):
        a.bucket_hashes(3)
    sc = ScopedSummary(8, tuple(changed), a.scoped_summary(8, changed))
    assert decode_scoped_summary(encode_scoped_summary(sc)) == sc
    assert decode_buckets(encode_buckets(after)) == after
    other = (bucket_of(a.peer_id, 8) + 1) % 8
    bad = [
        cbor2.dumps([7, b"\x00" * 12]),  # 3 buckets: not a power of two
        cbor2.dumps([7, b"\x00" * 5]),
        cbor2.dumps([8, 3, [0], []]),
        cbor2.dumps([8, 8, [8], []]),
        cbor2.dumps([8, 8, [1, 1], []]),
        cbor2.dumps([8, 8, [other], [[a.peer_id, 1, 2]]]),  # entry outside its buckets
    ]
    for data in bad:
        for decode in (decode_buckets, decode_scoped_summary):
            with pytest.raises(AntiEntropyError):
                decode(data)

    @given(st.binary(max_size=200))
    @settings(max_examples=200)
    def fuzz(data):
        for decode in (decode_buckets, decode_scoped_summary):
            try:
                decode(data)
            except AntiEntropyError:
                pass

    fuzz()


@pytest.mark.parametrize("fanout", [1, 3])
def test_bucket_exchanges_converge_64_lossy_peers_in_logarithmic_rounds(fanout):
    n, loss = 64, 0.2
    rng = random.Random(11)
    nodes = [node(3000 + i, ttl=600.0, refresh_interval=60.0) for i in range(n)]
    t = T0

    def round_():
        nonlocal t
        t += 1
        for nd in nodes:
            nd.tick(t)
        for i in rng.sample(range(n), n):
            for j in rng.sample([x for x in range(n) if x != i], fanout):
                if rng.random() >= loss:  # the whole exchange, or nothing of it
                    bucket_exchange(nodes[i], nodes[j], t)

    for k, nd in enumerate(nodes):
        nd.local_add_prefix(NS, shared_chain(4 + k % 5, 2, k))
    for _ in range(60):
        round_()
        if len({nd.summary_digest() for nd in nodes}) == 1:
            break
    nodes[0].local_add_prefix(NS2, shared_chain(6, 0, 200))
    bound = 2 * math.log(n + 1) / fanout + 4
    rounds = 0
    while len({nd.summary_digest() for nd in nodes}) > 1:
        round_()
        rounds += 1
        assert rounds <= bound, (fanout, rounds, bound)
