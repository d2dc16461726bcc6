"""Partial replication of digests (overlay/core/partition.py): pure-state tests with real
signed records, property tests of the partition map and codecs, and simulator runs."""

from __future__ import annotations

import hashlib
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.bench.sim import SimConfig, Simulator
from prefixmesh.bench.workloads import synthetic_workload
from prefixmesh.overlay.core.antientropy import AntiEntropy
from prefixmesh.overlay.core.digest import MAX_MODEL_FP_BYTES, LoadFigures
from prefixmesh.overlay.core.identity import Identity
from prefixmesh.overlay.core.partition import (
    ANSWER_HOLDERS,
    HolderMatch,
    LookupCache,
    NotAHome,
    OverBudget,
    PartitionConfig,
    PartitionedDigest,
    PartitionMessageError,
    decode_ack,
    decode_lookup,
    decode_lookup_answer,
    decode_push,
    encode_ack,
    encode_lookup,
    encode_lookup_answer,
    encode_push,
    partition_homes,
    partition_key,
    partition_model_fp,
    partition_of,
)

MODEL = b"test-model-fp"
NS = b"N" * 8
OTHER_NS = b"O" * 8
BUDGET = 64 * 1024


def _ident(i: int) -> Identity:
    return Identity.from_seed(bytes([i + 1]) * 32)


def _node(i: int, **config) -> PartitionedDigest:
    ident = _ident(i)

    def make_stream(fp: bytes, now: float) -> AntiEntropy:
        return AntiEntropy(ident, fp, epoch=1, now=now, ttl=600.0, refresh_interval=200.0,
                           min_record_interval=5.0)  # fmt: skip

    cfg = PartitionConfig(**{"n_partitions": 16, "replicas": 2, **config})
    return PartitionedDigest(ident, MODEL, config=cfg, make_stream=make_stream)


def _chain(seed: int, n: int = 8) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(8) for _ in range(n)]


class Net:
    """A few PartitionedDigest nodes exchanging the real encoded messages by hand."""

    def __init__(self, n: int, **config) -> None:
        self.nodes = [_node(i, **config) for i in range(n)]
        self.by_pid = {nd.peer_id: nd for nd in self.nodes}
        self.pids = [nd.peer_id for nd in self.nodes]
        self.bytes = 0

    def round(self, now: float, *, drop_pushes: bool = False, drop_acks: bool = False) -> int:
        """Tick everyone and deliver every push (and its ack); returns pushes sent."""
        sent = 0
        for nd in self.nodes:
            nd.tick(now)
            for push in nd.pushes(now, self.pids, BUDGET):
                sent += 1
                data = encode_push(push.partition, push.records)
                self.bytes += len(data)
                if drop_pushes:
                    continue
                home = self.by_pid[push.home]
                p, raws = decode_push(data)
                entries, _ = home.receive_push(nd.peer_id, p, raws, now, self.pids)
                ack = encode_ack(p, entries)
                self.bytes += len(ack)
                if not drop_acks:
                    nd.receive_ack(home.peer_id, *decode_ack(ack))
        return sent

    def lookup(self, router: PartitionedDigest, chain: list[bytes]) -> dict[bytes, int]:
        p = router.partition(NS, chain)
        home = self.by_pid[router.homes(p, self.pids)[0]]
        p2, ns, ch = decode_lookup(encode_lookup(p, NS, chain))
        answer = decode_lookup_answer(encode_lookup_answer(home.lookup(p2, ns, ch)))
        return {h.peer: h.blocks for h in answer}


# --- the partition map ---------------------------------------------------------------------


@given(st.lists(st.binary(min_size=8, max_size=8), min_size=1, max_size=12),
       st.integers(1, 8), st.integers(1, 4096))  # fmt: skip
def test_chains_sharing_the_key_depth_share_a_partition(chain, depth, n_partitions):
    p = partition_of(NS, partition_key(chain, depth), n_partitions)
    assert 0 <= p < n_partitions
    if len(chain) >= depth:
        longer = chain + [b"x" * 8, b"y" * 8]
        assert partition_of(NS, partition_key(longer, depth), n_partitions) == p


def test_partitions_spread_and_depend_on_namespace():
    roots = [random.Random(i).randbytes(8) for i in range(4000)]
    counts = [0] * 16
    for r in roots:
        counts[partition_of(NS, r, 16)] += 1
    assert min(counts) > 150  # 250 expected per partition
    assert any(partition_of(NS, r, 16) != partition_of(OTHER_NS, r, 16) for r in roots[:20])


@settings(max_examples=60)
@given(st.integers(0, 1000), st.integers(2, 20), st.integers(1, 5), st.integers(0, 2**31))
def test_homes_are_rendezvous_stable(p, n, r, seed):
    rng = random.Random(seed)
    nodes = [rng.randbytes(38) for _ in range(n)]
    homes = partition_homes(p, nodes, r)
    assert len(homes) == min(r, n) and len(set(homes)) == len(homes)
    assert set(homes) <= set(nodes)
    assert partition_homes(p, list(reversed(nodes)), r) == homes  # order-independent
    newcomer = rng.randbytes(38)
    after = partition_homes(p, nodes + [newcomer], r)
    # a join changes the home set only by admitting the newcomer
    assert set(after) - {newcomer} <= set(homes)
    if newcomer not in after:
        assert after == homes
    # a leave of a non-home changes nothing
    non_homes = [x for x in nodes if x not in homes]
    if non_homes:
        assert partition_homes(p, [x for x in nodes if x != non_homes[0]], r) == homes


def test_partition_fingerprint_binds_partition_and_count():
    fps = {partition_model_fp(MODEL, p, n) for p in range(4) for n in (4, 8)}
    assert len(fps) == 8
    with pytest.raises(ValueError, match="no room"):
        partition_model_fp(b"m" * MAX_MODEL_FP_BYTES, 0, 4)


@pytest.mark.parametrize(
    "kwargs",
    [{"n_partitions": 0}, {"n_partitions": 70000}, {"replicas": 0}, {"replicas": 17},
     {"key_depth": 0}, {"lookup_ttl_s": -1.0}, {"lookup_ttl_s": float("nan")},
     {"resend_after_s": 0.0}, {"max_origin_bytes": 0}, {"max_held_bytes": True},
     {"max_held_bytes": 1.5}],
)  # fmt: skip
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        PartitionConfig(**kwargs)


# --- dissemination and lookups -------------------------------------------------------------


def test_push_reaches_exactly_the_homes_and_lookup_finds_the_holder():
    net = Net(6)
    origin = net.nodes[0]
    chain = _chain(1)
    origin.local_add_prefix(NS, chain, 0.0)
    assert net.round(0.0) >= 1
    p = origin.partition(NS, chain)
    homes = set(origin.homes(p, net.pids))
    for nd in net.nodes:
        index = nd.indexes.get(p)
        knows = index is not None and index.longest_match(origin.peer_id, NS, chain) == 8
        assert knows == (nd.peer_id in homes or nd is origin), nd.peer_id in homes
    # in sync: nothing more to push
    assert net.round(1.0) == 0
    # any router finds the holder through a home, with the matched block count
    router = next(nd for nd in net.nodes if nd.peer_id not in homes and nd is not origin)
    assert net.lookup(router, chain + _chain(99, 3)) == {origin.peer_id: 8}
    assert net.lookup(router, chain[:5]) == {origin.peer_id: 5}
    # a chain sharing fewer than key_depth blocks lands elsewhere (and would not pay)
    assert net.lookup(router, _chain(2)) == {}


def test_removal_reaches_the_homes():
    net = Net(5)
    origin, router = net.nodes[0], net.nodes[1]
    chain = _chain(3)
    origin.local_add_prefix(NS, chain, 0.0)
    net.round(0.0)
    assert net.lookup(router, chain) == {origin.peer_id: 8}
    origin.local_remove_prefix(NS, chain, 1.0)
    net.round(10.0)  # after the 5 s batching interval
    assert net.lookup(router, chain) == {}


def test_namespace_holders_are_what_the_homed_partitions_know():
    net = Net(6)
    origin = net.nodes[0]
    chain = _chain(4)
    origin.local_add_prefix(NS, chain, 0.0)
    net.round(0.0)
    homes = set(origin.homes(origin.partition(NS, chain), net.pids))
    for nd in net.nodes:
        expected = {origin.peer_id} if nd.peer_id in homes and nd is not origin else set()
        assert nd.namespace_holders(NS) == expected
        assert nd.namespace_holders(OTHER_NS) == set()
    origin.local_remove_prefix(NS, chain, 1.0)
    net.round(10.0)
    assert all(nd.namespace_holders(NS) == set() for nd in net.nodes)


def test_a_home_holds_at_most_its_byte_budgets_across_partitions():
    """One origin cannot fill every partition a node homes: past ``max_origin_bytes`` of
    its records (all partitions together) its pushes are refused, other origins still get
    in until ``max_held_bytes``; once records expire the budgets free up again."""
    net = Net(4, replicas=4, max_origin_bytes=6000, max_held_bytes=10_000)
    home, flooder, other, late = net.nodes
    refused: list[tuple[PartitionedDigest, int]] = []

    def deliver(origin: PartitionedDigest, now: float) -> int:
        origin.tick(now)
        largest = 0
        for push in origin.pushes(now, net.pids, BUDGET):
            if push.home != home.peer_id:
                continue
            largest = max(largest, sum(map(len, push.records)))
            try:
                entries, _ = home.receive_push(origin.peer_id, push.partition, push.records,
                                               now, net.pids)
            except OverBudget:
                refused.append((origin, push.partition))
                continue
            origin.receive_ack(home.peer_id, push.partition, entries)
        return largest

    largest = 0
    for i in range(40):  # a prefix every 6 s (past the 5 s batching: each is a record)
        flooder.local_add_prefix(NS, _chain(1000 + i), 6.0 * i)
        largest = max(largest, deliver(flooder, 6.0 * i))
    assert refused and all(o is flooder for o, _ in refused)
    assert 6000 <= home.origin_held_bytes(flooder.peer_id) < 6000 + largest
    assert home.stats["over_budget_pushes"] == len(refused)
    # another origin is still welcome, up to the total budget
    for i in range(40):
        other.local_add_prefix(NS, _chain(2000 + i), 240.0 + 6.0 * i)
        largest = max(largest, deliver(other, 240.0 + 6.0 * i))
    assert any(o is other for o, _ in refused)
    assert 10_000 <= home.remote_bytes < 10_000 + largest
    home.tick(480.0)  # nothing expired yet: the count holds across a tick
    assert 10_000 <= home.remote_bytes < 10_000 + largest
    n_refused = len(refused)
    late.local_add_prefix(NS, _chain(3000), 480.0)
    deliver(late, 480.0)
    assert len(refused) == n_refused + 1 and home.origin_held_bytes(late.peer_id) == 0
    # records expire (ttl 600 s, nothing refreshed): budgets free up, the late origin
    # (whose refused push is resent) gets in
    home.tick(1200.0)
    assert home.remote_bytes == 0 and home.origin_held_bytes(flooder.peer_id) == 0
    deliver(late, 1200.0)
    assert home.origin_held_bytes(late.peer_id) > 0


def test_known_matches_prefers_the_home_index_then_the_carried_list_then_the_cache():
    net = Net(6)
    origin = net.nodes[0]
    chain = _chain(5)
    origin.local_add_prefix(NS, chain, 0.0)
    net.round(0.0)
    p = origin.partition(NS, chain)
    homes = origin.homes(p, net.pids)
    home = net.by_pid[homes[0]] if homes[0] != origin.peer_id else net.by_pid[homes[1]]
    router = next(nd for nd in net.nodes if nd.peer_id not in homes)
    carried = {b"c" * 38: 3}
    # a home reads its own index, whatever the request carries
    assert home.known_matches(NS, chain, net.pids, 1.0, carried=carried)[0] == \
        {origin.peer_id: 8}
    # a router with nothing cached: a lookup is needed, unless the request carries a list
    assert router.known_matches(NS, chain, net.pids, 1.0) == (None, homes)
    assert router.known_matches(NS, chain, net.pids, 1.0, carried=carried)[0] == carried
    # with a cached answer: the carried list (decided for this very request) still wins
    load = LoadFigures(0, 0, 100.0, 10.0)
    router.take_answer(NS, chain, [HolderMatch(origin.peer_id, 8, load, 600.0)], 1.0)
    assert router.known_matches(NS, chain, net.pids, 1.5)[0] == {origin.peer_id: 8}
    assert router.known_matches(NS, chain, net.pids, 1.5, carried=carried)[0] == carried


def test_homes_answer_for_themselves_and_others():
    net = Net(3, replicas=3)  # everyone is a home
    chain = _chain(4)
    for nd in net.nodes:
        nd.local_add_prefix(NS, chain, 0.0)
    net.round(0.0)
    p = net.nodes[0].partition(NS, chain)
    for nd in net.nodes:
        assert {h.peer for h in nd.lookup(p, NS, chain)} == set(net.pids)


def test_an_answer_lists_the_longest_matches_lighter_load_first_and_at_most_the_cap():
    n = ANSWER_HOLDERS + 6
    net = Net(n, replicas=1)
    chain = _chain(5, 10)
    # holder i caches 4 + i % 6 blocks and is as busy as i // 6 says
    for i, nd in enumerate(net.nodes):
        nd.set_local_load(LoadFigures(i // 6, 0, 100.0, 10.0), 1 << 30, 0)
        nd.local_add_prefix(NS, chain[: 4 + i % 6], 0.0)
    net.round(1.0)  # later than the streams' creation: their first records carry the load
    p = net.nodes[0].partition(NS, chain)
    home = net.by_pid[net.nodes[0].homes(p, net.pids)[0]]
    answer = decode_lookup_answer(encode_lookup_answer(home.lookup(p, NS, chain)))
    assert len(answer) == ANSWER_HOLDERS
    ranked = sorted(range(n), key=lambda i: (-(4 + i % 6), i // 6, net.pids[i]))
    assert [h.peer for h in answer] == [net.pids[i] for i in ranked[:ANSWER_HOLDERS]]
    assert [h.blocks for h in answer] == sorted((h.blocks for h in answer), reverse=True)


def test_lost_pushes_and_acks_are_resent_and_converge():
    net = Net(5)
    origin = net.nodes[0]
    chain = _chain(5)
    origin.local_add_prefix(NS, chain, 0.0)
    assert net.round(0.0, drop_pushes=True) >= 1
    assert net.round(1.0) == 0  # in flight: wait resend_after_s
    assert net.round(5.5, drop_acks=True) >= 1  # resent; delivered but the ack is lost
    assert net.round(11.0) >= 1  # resent again (duplicates are ignored), now acknowledged
    assert net.round(12.0) == 0
    router = next(nd for nd in net.nodes if nd is not origin)
    assert net.lookup(router, chain) == {origin.peer_id: 8}
    p = origin.partition(NS, chain)
    for home in origin.homes(p, net.pids):
        assert net.by_pid[home].streams[p].version_of(origin.peer_id) == origin.streams[
            p
        ].version_of(origin.peer_id)


def test_a_home_that_missed_records_gets_them_from_its_acknowledged_version():
    net = Net(4, replicas=1)
    origin = net.nodes[0]
    chains = [_chain(10 + i) for i in range(3)]
    # three prefixes in one partition (same key block), added over time
    base = _chain(10)
    chains = [base[:4] + _chain(20 + i, 4) for i in range(3)]
    origin.local_add_prefix(NS, chains[0], 0.0)
    net.round(0.0)
    origin.local_add_prefix(NS, chains[1], 1.0)
    net.round(6.0, drop_pushes=True)  # a delta is lost
    origin.local_add_prefix(NS, chains[2], 7.0)
    net.round(12.0)  # the next push starts from what the home acknowledged
    router = next(nd for nd in net.nodes if nd is not origin)
    for c in chains:
        assert net.lookup(router, c) == {origin.peer_id: 8}


def test_push_to_a_non_home_is_refused_and_a_replay_across_partitions_is_rejected():
    net = Net(6)
    origin = net.nodes[0]
    chain = _chain(6)
    origin.local_add_prefix(NS, chain, 0.0)
    origin.tick(0.0)
    pushes = origin.pushes(0.0, net.pids, BUDGET)
    p = pushes[0].partition
    homes = set(origin.homes(p, net.pids))
    outsider = next(nd for nd in net.nodes if nd.peer_id not in homes and nd is not origin)
    with pytest.raises(NotAHome):
        outsider.receive_push(origin.peer_id, p, pushes[0].records, 0.0, net.pids)
    # the same signed records presented as another partition's, at one of its homes
    q = next(q for q in range(16) if q != p)
    q_home = net.by_pid[origin.homes(q, net.pids)[0]]
    entries, applied = q_home.receive_push(origin.peer_id, q, pushes[0].records, 0.0, net.pids)
    assert applied == [] and entries == {}
    assert q_home.streams[q].stats["rejected"]["WrongModel"] == len(pushes[0].records)
    with pytest.raises(PartitionMessageError):
        q_home.receive_push(origin.peer_id, 16, pushes[0].records, 0.0, net.pids)


def test_load_view_keeps_the_freshest_figures():
    nd = _node(0)
    peer = _ident(1).peer_id
    old = HolderMatch(peer, 3, LoadFigures(9, 1, 1.0, 1.0), 100.0)
    new = HolderMatch(peer, 3, LoadFigures(0, 0, 2.0, 2.0), 200.0)
    nd.note_answer([new, old])
    assert nd.load_of(peer) == (new.load, 200.0)
    assert nd.known_peers() == [peer]


def test_lookup_cache_reuses_an_answer_only_where_it_is_exact():
    cache = LookupCache(ttl_s=2.0, key_depth=4)
    chain = _chain(7, 10)
    peer, other_peer = _ident(1).peer_id, _ident(2).peer_id
    holders = [HolderMatch(peer, 6, LoadFigures(), 50.0),
               HolderMatch(other_peer, 4, LoadFigures(), 50.0)]  # fmt: skip
    cache.put(NS, chain, holders, 0.0)
    assert cache.get(NS, chain, 1.0) == holders
    # agrees on the 6 blocks some holder matched: the same answer, exactly
    assert cache.get(NS, chain[:6] + _chain(8, 5), 1.0) == holders
    # departs at block 5, before the longest match: a miss (look up afresh)
    assert cache.get(NS, chain[:5] + _chain(8, 5), 1.0) is None
    assert cache.get(NS, chain[:5], 1.0) is None  # shorter than what was matched
    assert cache.get(NS, chain, 2.0) is None  # expired
    assert cache.get(OTHER_NS, chain, 1.0) is None
    assert LookupCache(ttl_s=0.0, key_depth=4).get(NS, chain, 0.0) is None
    empty = LookupCache(ttl_s=2.0, key_depth=4)
    empty.put(NS, chain, [], 0.0)  # nobody holds it: any chain with this key misses too
    assert empty.get(NS, chain[:4] + _chain(9, 3), 1.0) == []


def _chained(symbols: list[int]) -> list[bytes]:
    """Block hashes as the real chain has them: each names its whole prefix."""
    out, prev = [], b""
    for x in symbols:
        prev = hashlib.blake2b(prev + bytes([x]), digest_size=8).digest()
        out.append(prev)
    return out


@settings(max_examples=60, deadline=None)  # builds signed records: slow on a busy machine
@given(st.lists(st.integers(0, 2), min_size=1, max_size=8),
       st.lists(st.integers(0, 2), min_size=1, max_size=8),
       st.lists(st.tuples(st.booleans(), st.integers(3, 10)), min_size=1, max_size=3))  # fmt: skip
def test_lookup_cache_never_overstates_and_lists_every_holder(a, b, holdings):
    """For two chains with one key block, a cached answer, when reused, lists exactly the
    nodes a fresh lookup would, each credited with at most (and, short of the point where
    the chains depart, exactly) its fresh match."""
    net = Net(1 + len(holdings), replicas=4, key_depth=2)
    chain_a = _chained([7, 7] + a)
    chain_b = _chained([7, 7] + b)
    for nd, (use_a, n) in zip(net.nodes[1:], holdings, strict=True):
        nd.local_add_prefix(NS, (chain_a if use_a else chain_b)[:n], 0.0)
    net.round(0.0)
    router = net.nodes[0]
    p = router.partition(NS, chain_a)
    assert router.partition(NS, chain_b) == p
    cache = LookupCache(ttl_s=5.0, key_depth=2)
    cache.put(NS, chain_a, router.lookup(p, NS, chain_a), 0.0)
    cached = cache.get(NS, chain_b, 1.0)
    if cached is None:
        return
    fresh = {h.peer: h.blocks for h in router.lookup(p, NS, chain_b)}
    got = {h.peer: h.blocks for h in cached}
    assert set(got) == set(fresh)
    common = next((i for i, (x, y) in enumerate(zip(chain_a, chain_b, strict=False)) if x != y),
                  min(len(chain_a), len(chain_b)))  # fmt: skip
    for peer, blocks in got.items():
        assert blocks <= fresh[peer]
        if blocks < common:
            assert blocks == fresh[peer]


# --- codecs ------------------------------------------------------------------------------------


@given(st.integers(0, 65535), st.lists(st.binary(max_size=300), max_size=20))
def test_push_round_trip(p, raws):
    assert decode_push(encode_push(p, raws)) == (p, raws)


@given(st.integers(0, 65535), st.dictionaries(st.binary(min_size=38, max_size=38),
       st.tuples(st.integers(0, 2**63 - 1), st.integers(0, 2**63 - 1)), max_size=8))  # fmt: skip
def test_ack_round_trip(p, entries):
    assert decode_ack(encode_ack(p, entries)) == (p, entries)


@given(st.integers(0, 65535), st.lists(st.binary(min_size=8, max_size=8), max_size=64))
def test_lookup_round_trip(p, chain):
    assert decode_lookup(encode_lookup(p, NS, chain)) == (p, NS, chain)


_holder = st.builds(
    HolderMatch,
    st.binary(min_size=38, max_size=38),
    st.integers(1, 4096),
    st.builds(LoadFigures, st.integers(0, 1000), st.integers(0, 100),
              st.floats(0, 1e9), st.floats(0, 1e9)),  # fmt: skip
    st.floats(0, 1e10),
)


@given(st.lists(_holder, max_size=20))
def test_lookup_answer_round_trip(holders):
    assert decode_lookup_answer(encode_lookup_answer(holders)) == holders


@pytest.mark.parametrize(
    "data",
    [b"", b"\xa0", encode_push(1, [])[:-1], encode_ack(1, {}) + b"\x00",
     encode_lookup(1, b"short", []), encode_lookup(70000, NS, [])],
)  # fmt: skip
def test_bad_messages_raise_the_typed_error(data):
    for decode in (decode_push, decode_ack, decode_lookup, decode_lookup_answer):
        with pytest.raises(PartitionMessageError):
            decode(data)


# --- the simulator -------------------------------------------------------------------------


def _run(**kw):
    wl = synthetic_workload(600, rate=8.0, n_docs=40, n_system=4, seed=3)
    base = dict(nodes=16, bucket_summaries=True, compaction_ratio=4.0, min_record_interval_s=5.0)
    return Simulator(wl, SimConfig(**{**base, **kw})).run().metrics


def test_sim_partitioned_keeps_hits_and_cuts_digest_traffic():
    full = _run()
    part = _run(partitions=64)
    assert part["hit_ratio"] >= 0.95 * full["hit_ratio"]
    assert part["digest_bytes_per_node_s"] < full["digest_bytes_per_node_s"] / 2
    assert part["lookups"] > 0 and part["lookup_bytes_per_node_s"] > 0
    assert full["lookups"] == 0


def test_sim_partitioned_is_deterministic_and_decoding_changes_nothing():
    a = _run(partitions=32, nodes=8)
    b = _run(partitions=32, nodes=8, decode_messages=True)
    for m in (a, b):
        m.pop("requests_per_wall_minute")
        m.pop("requests_per_cpu_minute")
    assert a == b


def test_sim_lookups_stop_when_they_cannot_pay():
    """At 1.5 s one-way a lookup plus a forward (6 s) costs more than prefilling any of
    these prompts (at most ~1,700 tokens at 420 tok/s): routers that are not homes skip
    the lookup and serve with what they know."""
    wl = synthetic_workload(200, rate=2.0, n_docs=20, n_system=2, seed=5)
    near = Simulator(wl, SimConfig(nodes=16, partitions=64, delay_ms=1.0)).run().metrics
    far = Simulator(wl, SimConfig(nodes=16, partitions=64, delay_ms=1500.0)).run().metrics
    assert near["lookups"] > 0 and near["lookups_skipped"] == 0
    assert far["lookups_skipped"] > 0 and far["lookups"] == 0


def test_sim_partitioned_convergence_is_one_round_whatever_n():
    from prefixmesh.bench.sim import measure_convergence  # noqa: PLC0415

    for n in (16, 128):
        r = measure_convergence(n, fanout=3, partitions=64)
        assert r["converged"]
        assert r["convergence_intervals"] <= 1.0 + 0.01  # next tick + one link delay


def test_sim_partitioned_idle_traffic_is_refreshes_only():
    from prefixmesh.bench.sim import measure_idle_digest  # noqa: PLC0415

    # 60 s: the counted half (30-60 s) holds refreshes at 20 s but none at 300 s
    quiet = measure_idle_digest(8, duration_s=60.0, partitions=64, partition_refresh_s=300.0)
    assert quiet["digest_bytes_per_node_s"] == 0.0  # no refresh falls in the counted half
    busy = measure_idle_digest(8, duration_s=60.0, partitions=64, partition_refresh_s=20.0)
    assert busy["digest_bytes_per_node_s"] > 0.0


def test_sim_cli_partition_flags():
    import argparse  # noqa: PLC0415

    from prefixmesh.bench.sim import add_sim_arguments, config_from_args  # noqa: PLC0415

    p = argparse.ArgumentParser()
    add_sim_arguments(p)
    cfg = config_from_args(p.parse_args(["--partitions", "128", "--replicas", "2",
                                         "--lookup-ttl", "0.5", "--partition-refresh", "60"]))
    assert (cfg.partitions, cfg.replicas, cfg.lookup_ttl_s) == (128, 2, 0.5)
    assert (cfg.partition_refresh_s, cfg.partition_ttl_s) == (60.0, 180.0)
    with pytest.raises(ValueError, match="replicas"):
        Simulator(synthetic_workload(10, seed=1), SimConfig(nodes=4, partitions=8, replicas=0))


def test_antientropy_origin_restriction_and_restate():
    ident = _ident(0)
    ae = AntiEntropy(ident, MODEL, epoch=1, now=0.0, ttl=600.0, refresh_interval=200.0,
                     min_record_interval=5.0)  # fmt: skip
    other = AntiEntropy(_ident(1), MODEL, epoch=1, now=0.0, ttl=600.0, refresh_interval=200.0)
    other.local_add_prefix(NS, _chain(1))
    other.tick(0.0)
    ae.receive([s.raw for s in other.held_records(other.peer_id)], 0.0)
    assert {s.record.origin for s in ae.records_for({}, BUDGET)} == {ident.peer_id,
                                                                      other.peer_id}
    only = ae.records_for({}, BUDGET, origins=(ident.peer_id,))
    assert {s.record.origin for s in only} == {ident.peer_id}
    ae.local_add_prefix(NS, _chain(2))
    assert ae.tick(1.0) == []  # batched: a delta may go out only 5 s after the last record
    restated = ae.restate(1.0)
    assert [s.record.kind for s in restated] == ["snapshot"]
    assert ae.version_of(ident.peer_id) == (1, restated[-1].record.seq)
    assert ae.version_of(b"\x00" * 38) is None
