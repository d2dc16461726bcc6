"""Partial replication in the node (``[digest].partitions > 0``).

Part 1: :class:`~prefixmesh.overlay.partgossip.PartitionGossip` between real libp2p hosts
on 127.0.0.1 in one process (no heartbeat: each node's members are given): an origin's
push reaches the home of its prefix's partition and is acknowledged; a third node's
lookup at that home returns the origin as holder; a malformed message and a push to a
node that is not a home are counted and the responder keeps answering.

Part 2 (slow): four real node processes with the real model and ``partitions = 16,
replicas = 2``: a prompt served at one node is routed there when it enters at a node that
is not a home of its partition (the entry node looks the holder up at a home), and when it
enters at a home (which reads its own partition index, no lookup).
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest
import trio

from prefixmesh.overlay.core import wire
from prefixmesh.overlay.core.antientropy import AntiEntropy
from prefixmesh.overlay.core.identity import Identity
from prefixmesh.overlay.core.partition import (
    PartitionConfig,
    PartitionedDigest,
    Push,
    encode_push,
)
from prefixmesh.overlay.host import FramedStream, HostError, OverlayHost
from prefixmesh.overlay.partgossip import PartitionGossip

MODEL = b"model-fp-test-00"
NS = b"N" * 8
ADDRS = ["/ip4/127.0.0.1/tcp/4999"]
CONFIG = PartitionConfig(n_partitions=16, replicas=1)


def _pgossip(host: OverlayHost, identity: Identity, members: list[bytes], learned=None,
             **kw) -> PartitionGossip:
    def make_stream(fp: bytes, now: float) -> AntiEntropy:
        return AntiEntropy(identity, fp, epoch=int(now * 1000), now=now, ttl=900.0,
                           refresh_interval=300.0, addrs=ADDRS)

    pd = PartitionedDigest(identity, MODEL, config=CONFIG, make_stream=make_stream)
    on_learn = (lambda peer, addrs: learned.append((peer, list(addrs)))) if learned is not None \
        else None
    return PartitionGossip(host, pd, peers=lambda: members, on_learn=on_learn,
                           exchange_timeout_s=10.0, **kw)


def _chain_homed_at(pg: PartitionGossip, home: bytes, tag: int) -> list[bytes]:
    """A 6-block chain whose partition's (only) home is ``home`` among pg's members."""
    for k in range(1000):
        chain = [bytes([tag, k % 256, k // 256, i]) * 2 for i in range(6)]
        if pg.homes_of(NS, chain)[1] == [home]:
            return chain
    raise AssertionError("no chain found for that home")


async def _wait_for(predicate, timeout_s: float = 10.0) -> None:
    with trio.fail_after(timeout_s):
        while not predicate():
            await trio.sleep(0.01)


def test_push_reaches_the_home_is_acknowledged_and_a_lookup_finds_the_holder():
    a_id, h_id, r_id = Identity.generate(), Identity.generate(), Identity.generate()
    everyone = [a_id.peer_id, h_id.peer_id, r_id.peer_id]
    learned: list = []

    async def main():
        a, h, r = OverlayHost(a_id, []), OverlayHost(h_id), OverlayHost(r_id, [])
        pg_a = _pgossip(a, a_id, everyone)
        pg_h = _pgossip(h, h_id, everyone, learned)
        pg_r = _pgossip(r, r_id, everyone)
        pg_h.register()
        async with a.run(), h.run(), r.run():
            for peer_host in (a, r):
                await peer_host.connect(h_id.peer_id, h.listen_addrs(), 10)
            chain = _chain_homed_at(pg_a, h_id.peer_id, 1)
            p = pg_a.pd.partition(NS, chain)
            pg_a.pd.local_add_prefix(NS, chain, time.time())
            await pg_a.round()

            assert pg_a.stats["pushes_sent"] == 1 and pg_a.stats["acks"] == 1, pg_a.stats
            assert pg_h.stats["pushes_received"] == 1, pg_h.stats
            assert pg_h.stats["records_applied"] >= 1, pg_h.stats
            index = pg_h.pd.indexes[p]
            assert index.longest_matches(NS, chain) == {a_id.peer_id: len(chain)}
            assert (a_id.peer_id, ADDRS) in learned  # discovery hears of the origin
            await pg_a.round()  # acknowledged: nothing to resend
            assert pg_a.stats["pushes_sent"] == 1, pg_a.stats

            # r is not a home of p: it asks h
            assert r_id.peer_id not in pg_r.homes_of(NS, chain)[1]
            longer = [*chain, b"\x09" * 8]
            holders = await pg_r.lookup(h_id.peer_id, NS, longer, timeout_s=5.0)
            assert holders is not None
            assert [(m.peer, m.blocks) for m in holders] == [(a_id.peer_id, len(chain))]
            assert pg_h.stats["lookups_answered"] == 1
            assert pg_r.stats["lookup_answers"] == 1
            # the answer is cached for the partition key and its load figures noted
            cached = pg_r.lookup_cache.get(NS, longer, time.time())
            assert cached is not None and cached[0].peer == a_id.peer_id
            assert pg_r.pd.load_of(a_id.peer_id) is not None
            # a chain nobody holds: an empty answer, not an error
            other = _chain_homed_at(pg_r, h_id.peer_id, 2)
            assert await pg_r.lookup(h_id.peer_id, NS, other, timeout_s=5.0) == []

    trio.run(main)


def test_malformed_messages_and_pushes_to_a_non_home_are_counted_and_serving_goes_on():
    a_id, h_id = Identity.generate(), Identity.generate()
    everyone = [a_id.peer_id, h_id.peer_id]

    async def main():
        a, h = OverlayHost(a_id, []), OverlayHost(h_id)
        pg_a = _pgossip(a, a_id, everyone)
        pg_h = _pgossip(h, h_id, everyone)
        pg_h.register()
        async with a.run(), h.run():
            await a.connect(h_id.peer_id, h.listen_addrs(), 10)

            async def send_raw(payload: bytes) -> None:
                stream = await a.open_stream(h_id.peer_id, wire.PARTITION_PROTOCOL, 10)
                fs = FramedStream(stream, timeout_s=10)
                await fs.send_raw(payload)
                with pytest.raises(HostError):  # closed unanswered
                    await fs.receive_raw()
                await fs.close()

            await send_raw(b"\xff\x00garbage")  # not CBOR of any known message
            await _wait_for(lambda: pg_h.stats["malformed"] == 1)
            await send_raw(encode_push(3, [b"not a signed record"])[:-3])  # truncated
            await _wait_for(lambda: pg_h.stats["malformed"] == 2)

            # a push for a partition whose home is a, sent to h anyway: refused
            chain = _chain_homed_at(pg_a, a_id.peer_id, 3)
            p = pg_a.pd.partition(NS, chain)
            pg_a.pd.local_add_prefix(NS, chain, time.time())
            pg_a.pd.tick(time.time())
            records = [s.raw for s in pg_a.pd.streams[p].held_records(a_id.peer_id)]
            assert await pg_a._push_guarded(Push(h_id.peer_id, p, records)) is False
            assert pg_a.stats["pushes_failed"] == 1, pg_a.stats
            await _wait_for(lambda: pg_h.stats["refused"] == 1)
            assert p not in pg_h.pd.indexes  # nothing of it was kept

            # h still serves: a proper push for one of its partitions is acknowledged
            mine = _chain_homed_at(pg_a, h_id.peer_id, 4)
            pg_a.pd.local_add_prefix(NS, mine, time.time())
            await pg_a.round()
            assert pg_a.stats["acks"] == 1, pg_a.stats
            q = pg_a.pd.partition(NS, mine)
            assert pg_h.pd.indexes[q].longest_matches(NS, mine) == {a_id.peer_id: len(mine)}

            # past its byte budget for a, h refuses a's next push: closed unanswered,
            # counted, nothing kept, and h goes on answering
            pg_h.pd.config = replace(CONFIG, max_origin_bytes=1)
            more = _chain_homed_at(pg_a, h_id.peer_id, 5)
            pg_a.pd.local_add_prefix(NS, more, time.time())
            await pg_a.round()
            # (refused on the kept-open stream, then once more on a fresh one)
            await _wait_for(lambda: pg_h.stats["over_budget"] >= 1)
            assert pg_a.stats["pushes_failed"] == 2, pg_a.stats
            r = pg_a.pd.partition(NS, more)
            assert r not in pg_h.pd.indexes or pg_h.pd.indexes[r].longest_matches(NS, more) == {}
            assert await pg_a.lookup(h_id.peer_id, NS, mine, timeout_s=5.0) is not None
            assert pg_h.stats["answers_crashed"] == 0

    trio.run(main)


def test_responder_limits_refuse_a_flooding_peer_before_reading():
    a_id, h_id = Identity.generate(), Identity.generate()
    everyone = [a_id.peer_id, h_id.peer_id]
    clock = [1000.0]

    async def main():
        a, h = OverlayHost(a_id, []), OverlayHost(h_id)
        pg_a = _pgossip(a, a_id, everyone)
        pg_h = _pgossip(h, h_id, everyone, request_rate_per_s=1.0, request_burst=3.0,
                        limit_clock=lambda: clock[0])
        pg_h.register()
        async with a.run(), h.run():
            await a.connect(h_id.peer_id, h.listen_addrs(), 10)
            chain = _chain_homed_at(pg_a, h_id.peer_id, 5)
            answers = [await pg_a.lookup(h_id.peer_id, NS, chain, 5.0) for _ in range(5)]
            assert answers[:3] == [[], [], []]
            assert answers[3:] == [None, None]  # refused: a routing miss, not an error
            assert pg_h.stats["rate_limited"] == 2 and pg_h.stats["lookups_answered"] == 3
            clock[0] += 1.0  # one token back
            assert await pg_a.lookup(h_id.peer_id, NS, chain, 5.0) == []

    trio.run(main)


# --- part 2: real node processes, real model -------------------------------------------

LONG_SYSTEM = (
    "You are the archivist of a harbour museum. Answer in one short sentence. The archive "
    "holds ship logs, harbour maps, customs ledgers, lighthouse journals, tide tables, "
    "photographs of cranes, letters from sailors and records of every ship built here. "
) * 5


def _seen_idle(entry, holder) -> None:
    """Wait until the entry's view of the holder's load (heartbeat PONGs) shows it idle."""
    from _swarm import peers, wait_until

    def idle() -> bool:
        info = {p.peer: p for p in peers(entry.addr).peers}.get(holder.peer_id)
        return info is not None and info.up and info.active == 0 and info.queue_depth == 0

    wait_until(idle, timeout_s=10, interval_s=0.2, what=f"{entry.name} to see {holder.name} idle")


@pytest.mark.slow
def test_partitioned_swarm_routes_a_non_home_entry_to_the_holder(tmp_path):
    from _swarm import Swarm, ask, peers, wait_until

    config = tmp_path / "partitioned.toml"
    config.write_text("[digest]\npartitions = 16\nreplicas = 2\n")
    extra = ["--config", str(config)]
    prompt = [("system", LONG_SYSTEM), ("user", "Where are the tide tables kept?")]
    with Swarm(tmp_path) as s:
        # every node dials every earlier one: the same membership everywhere, hence the
        # same homes (records no longer reach every node, so gossip cannot introduce them)
        a = s.add("A", extra=extra)
        b = s.add("B", bootstrap=[a.addr], extra=extra)
        c = s.add("C", bootstrap=[a.addr, b.addr], extra=extra)
        d = s.add("D", bootstrap=[a.addr, b.addr, c.addr], extra=extra)
        nodes = [a, b, c, d]

        def all_up() -> bool:
            for n in nodes:
                up = {p.peer for p in peers(n.addr).peers if p.up}
                if up != {m.peer_id for m in nodes} - {n.peer_id}:
                    return False
            return True

        wait_until(all_up, timeout_s=30, what="every node to see every other up")
        first = ask(a.addr, prompt, max_tokens=4, hop_budget=0)
        assert first.final.serving == a.peer_id

        def a_pushes_acknowledged():
            st = peers(a.addr).stats
            sent, acks = st.get("part_pushes_sent", 0), st.get("part_acks", 0)
            return acks >= 1 and acks == sent and st

        wait_until(a_pushes_acknowledged, timeout_s=20, what="A's pushes to be acknowledged")
        # the homes of the prompt's partition (other than A) are the nodes A pushed to
        received = {n.name: peers(n.addr).stats.get("part_pushes_received", 0)
                    for n in (b, c, d)}
        homes = [n for n in (b, c, d) if received[n.name] > 0]
        entries = [n for n in (b, c, d) if received[n.name] == 0]
        assert 1 <= len(homes) <= 2 and entries, received
        for n in nodes:  # full replication is off: no node's gossip index fills
            assert all(p.n_hashes == 0 for p in peers(n.addr).peers)
        entry = entries[0]
        _seen_idle(entry, a)  # (load figures steer routing too)
        second = ask(entry.addr, prompt, max_tokens=4)
        fin = second.final
        assert fin.serving == a.peer_id, ([h.reason for h in fin.hops], s.logs())
        assert fin.entry == entry.peer_id
        assert fin.cached_tokens > 0
        assert [h.action for h in fin.hops] == ["forward", "serve"]
        assert fin.hops[0].peer == entry.peer_id and fin.hops[0].next_peer == a.peer_id
        st = peers(entry.addr).stats
        assert st.get("infer_partition_lookups", 0) == 1, st
        assert st.get("part_lookup_answers", 0) == 1, st
        assert second.text

        # a home of the partition reads its own partition index: no lookup, same route
        home = homes[0]
        _seen_idle(home, a)
        third = ask(home.addr, prompt, max_tokens=4)
        fin = third.final
        assert fin.serving == a.peer_id, [h.reason for h in fin.hops]
        assert [h.action for h in fin.hops] == ["forward", "serve"] and fin.cached_tokens > 0
        st = peers(home.addr).stats
        assert st.get("infer_partition_home_decisions", 0) == 1, st
        assert st.get("infer_partition_lookups", 0) == 0, st


def test_daemon_passes_the_batching_knob_to_full_and_partition_streams(tmp_path):
    """[digest] min_record_interval_s reaches the node's AntiEntropy and every partition
    stream it creates (capped at half the refresh interval)."""
    from prefixmesh.inference.backend import SimulatedBackend  # noqa: PLC0415
    from prefixmesh.node.config import load_config  # noqa: PLC0415
    from prefixmesh.node.daemon import Node, NodeOptions  # noqa: PLC0415
    from prefixmesh.overlay.core.identity import Identity  # noqa: PLC0415

    async def main():
        async with trio.open_nursery() as nursery:
            nodes = []
            for i, extra in enumerate(({}, {"digest.partitions": 16})):
                overrides = {
                    "node.cache_dir": str(tmp_path / f"n{i}"), "node.mdns": False,
                    "node.key_file": str(tmp_path / f"n{i}.key"), "digest.interval_s": 0.3,
                    "digest.min_record_interval_s": 5.0, **extra,
                }
                node = Node(load_config(None, overrides),
                            NodeOptions(backend="sim", dht=False, print_addrs=False, seed=i),
                            identity=Identity.generate(), backend=SimulatedBackend())
                await nursery.start(node.run)
                nodes.append(node)
            full, part = nodes
            assert full.ae.min_record_interval == 5.0 and full.pd is None
            ns = next(iter(part.tenants)).ns_id
            part.backend.insert_prefix(ns, list(range(100)))
            with trio.fail_after(10):
                while not part.pd.streams:
                    await trio.sleep(0.05)
            assert all(ae.min_record_interval == 5.0 for ae in part.pd.streams.values())
            for node in nodes:
                await node.shutdown(grace_s=0.1)

    trio.run(main)


def test_push_streams_are_reused_and_reopened_after_the_home_closes_them():
    """Pushes to one home travel on one stream (stream set-up cost more bytes than the
    records); when the home closes an idle stream, the next push opens a fresh one and
    nothing is lost."""
    a_id, h_id = Identity.generate(), Identity.generate()
    everyone = [a_id.peer_id, h_id.peer_id]

    async def main():
        a, h = OverlayHost(a_id, []), OverlayHost(h_id)
        pg_a = _pgossip(a, a_id, everyone, stream_idle_s=60.0)
        pg_h = _pgossip(h, h_id, everyone, stream_idle_s=0.25)  # the home closes fast
        pg_h.register()
        async with a.run(), h.run():
            await a.connect(h_id.peer_id, h.listen_addrs(), 10)
            chains = [_chain_homed_at(pg_a, h_id.peer_id, 10 + i) for i in range(3)]
            for chain in chains[:2]:
                pg_a.pd.local_add_prefix(NS, chain, time.time())
                await pg_a.round()
            assert pg_a.stats["acks"] == 2, pg_a.stats
            assert pg_a.stats["push_streams_opened"] == 1, pg_a.stats
            assert pg_a.stats["push_streams_reused"] == 1, pg_a.stats
            await trio.sleep(1.0)  # the home gives up on the silent stream (2 x 0.25 s)
            pg_a.pd.local_add_prefix(NS, chains[2], time.time())
            await pg_a.round()
            assert pg_a.stats["acks"] == 3, pg_a.stats
            assert pg_a.stats["push_streams_opened"] == 2, pg_a.stats
            for chain in chains:
                p = pg_a.pd.partition(NS, chain)
                assert pg_h.pd.indexes[p].longest_matches(NS, chain) == {a_id.peer_id: 6}
            assert pg_h.stats["answers_crashed"] == 0 and pg_h.stats["malformed"] == 0

    trio.run(main)


SYSTEM = "a long shared system prompt about routing requests to cached prefixes. " * 10


async def _partitioned_swarm(nursery, tmp_path, n: int, texts=None) -> list:
    """``n`` in-process nodes (real libp2p, simulated engine), each bootstrapped to every
    earlier one, ``[digest] partitions = 16, replicas = 2`` (and node i's config file text
    ``texts[i]``, e.g. tenants); returns once every node sees all the others up."""
    from prefixmesh.inference.backend import SimulatedBackend  # noqa: PLC0415
    from prefixmesh.node.config import load_config  # noqa: PLC0415
    from prefixmesh.node.daemon import Node, NodeOptions  # noqa: PLC0415

    nodes: list = []
    for i in range(n):
        overrides = {
            "node.cache_dir": str(tmp_path / f"n{i}"), "node.mdns": False,
            "node.key_file": str(tmp_path / f"n{i}.key"),
            "node.bootstrap": [nd.full_addrs()[0] for nd in nodes] or None,
            "digest.interval_s": 0.3, "digest.partitions": 16, "digest.replicas": 2,
        }
        node = Node(load_config(None, overrides, text=texts[i] if texts else None),
                    NodeOptions(backend="sim", dht=False, print_addrs=False, seed=i,
                                heartbeat_interval_s=0.3, heartbeat_timeout_s=1.0),
                    identity=Identity.generate(), backend=SimulatedBackend(prefill_tps=400.0))
        await nursery.start(node.run)
        nodes.append(node)
    await _wait_for(lambda: all(len(nd.heartbeat.up_peers()) == n - 1 for nd in nodes), 20)
    return nodes


def test_partitioned_swarm_rehomes_a_partition_when_a_home_leaves(tmp_path):
    """In-process nodes (real libp2p, simulated engine): a holder's partition records
    reach its homes; a non-home entry node finds the holder by a lookup; when a home shuts
    down, the heartbeat's membership changes, the partition gets a new home, the holder
    pushes its stream there unasked, and routing through a lookup still finds it."""
    from prefixmesh.node.client import Client  # noqa: PLC0415

    async def main():
        async with trio.open_nursery() as nursery:
            nodes = await _partitioned_swarm(nursery, tmp_path, 5)
            holder = nodes[0]
            hid = holder.identity.peer_id
            async with Client.connect(holder.full_addrs()[0]) as c:
                await c.ask([("system", SYSTEM), ("user", "x")], max_tokens=1, hop_budget=0)
            await _wait_for(lambda: len(holder.pd.streams) == 1)
            (p,) = holder.pd.streams

            def homes() -> list[bytes]:
                return holder.pd.homes(p, holder.exchange.members())

            def indexed_at(peer: bytes) -> bool:
                node = next(nd for nd in nodes if nd.identity.peer_id == peer)
                index = node.pd.indexes.get(p)
                return index is not None and hid in index.peers()

            await _wait_for(lambda: all(indexed_at(h) for h in homes() if h != hid))
            old_homes = homes()
            victim = next(nd for nd in nodes if nd.identity.peer_id in old_homes
                          and nd is not holder)
            routers = [nd for nd in nodes if nd.identity.peer_id not in old_homes
                       and nd is not holder]
            router = routers[0]
            async with Client.connect(router.full_addrs()[0]) as c:
                ans = await c.ask([("system", SYSTEM), ("user", "y")], max_tokens=1)
            assert ans.final.serving == hid and ans.final.cached_tokens > 0, ans.final
            assert router.infer.stats.get("partition_lookups") == 1, router.infer.stats

            await victim.shutdown(grace_s=0.1)
            vid = victim.identity.peer_id
            alive = [nd for nd in nodes if nd is not victim]
            await _wait_for(lambda: all(not nd.heartbeat.is_up(vid) for nd in alive), 20)
            new_homes = homes()
            assert vid not in new_homes and set(new_homes) != set(old_homes)
            await _wait_for(lambda: all(indexed_at(h) for h in new_homes if h != hid), 20)
            entry = next(nd for nd in alive if nd.identity.peer_id not in new_homes
                         and nd is not holder)
            async with Client.connect(entry.full_addrs()[0]) as c:
                ans = await c.ask([("system", SYSTEM), ("user", "z")], max_tokens=1)
            assert ans.final.serving == hid and ans.final.cached_tokens > 0, ans.final
            for nd in alive:
                await nd.shutdown(grace_s=0.1)

    trio.run(main)


def test_a_lookup_that_fails_at_the_first_home_is_asked_again_at_the_second(tmp_path):
    """The first home of the request's partition is up (heartbeats answered) but its
    partition protocol hangs: the entry node's lookup times out there, asks the second
    home, and still routes to the holder."""
    from prefixmesh.node.client import Client  # noqa: PLC0415

    async def main():
        async with trio.open_nursery() as nursery:
            nodes = await _partitioned_swarm(nursery, tmp_path, 5)
            by_id = {nd.identity.peer_id: nd for nd in nodes}
            # a holder that is not a home of its own partition, so both homes are others
            # (nodes tried before it hold the prompt too: they are homes, not entries)
            cached_at: list[bytes] = []
            for holder in nodes:
                cached_at.append(holder.identity.peer_id)
                async with Client.connect(holder.full_addrs()[0]) as c:
                    await c.ask([("system", SYSTEM), ("user", "x")], max_tokens=1,
                                hop_budget=0)
                await _wait_for(lambda h=holder: len(h.pd.streams) == 1)
                (p,) = holder.pd.streams
                homes = holder.pd.homes(p, holder.exchange.members())
                if holder.identity.peer_id not in homes:
                    break
            else:
                raise AssertionError("every node is a home of the prompt's partition")
            hid = holder.identity.peer_id

            def indexed_at(node) -> bool:
                index = node.pd.indexes.get(p)
                return index is not None and hid in index.peers()

            await _wait_for(lambda: all(indexed_at(by_id[h]) for h in homes))
            entry = next(nd for nd in nodes if nd.identity.peer_id not in homes
                         and nd.identity.peer_id not in cached_at)
            first = entry.pd.homes(p, entry.exchange.members())[0]
            assert first == homes[0]

            async def hang(stream) -> None:  # up, but never answers a partition message
                await trio.sleep_forever()

            by_id[first].host.set_handler(wire.PARTITION_PROTOCOL, hang)
            async with Client.connect(entry.full_addrs()[0]) as c:
                ans = await c.ask([("system", SYSTEM), ("user", "y")], max_tokens=1)
            assert ans.final.serving in cached_at and ans.final.cached_tokens > 0, ans.final
            assert ans.final.hops[0].action == "forward", ans.final.hops
            assert entry.infer.stats.get("partition_lookups") == 2, entry.infer.stats
            assert entry.infer.stats.get("partition_lookups_failed") == 1, entry.infer.stats
            for nd in nodes:
                await nd.shutdown(grace_s=0.1)

    trio.run(main)


def test_a_forwarded_request_carries_the_lookup_answer_to_the_next_hop(tmp_path):
    """A router that is not a home of the prompt's partition gets a forwarded request that
    carries the previous hop's holder list (``Request.holders``, what a lookup answered):
    it decides with that list, without a lookup of its own, and forwards on to the holder.
    Control: the same forwarded request without the list is served by the router itself
    (only entry nodes look up), as in the simulator."""
    from prefixmesh.inference.core.blocks import BLOCK_TOKENS, chain_hashes  # noqa: PLC0415
    from prefixmesh.node.client import Client  # noqa: PLC0415

    async def forwarded(router, messages, holders):
        """The request as an entry node that is not in the swarm would forward it."""
        tenant = next(iter(router.tenants))
        entry = Identity.generate().peer_id
        rid = os.urandom(16)
        deadline = time.time() + 30
        tokens = await router.backend.tokenize(messages)
        req = tenant.sign(wire.Request(
            id=rid, ns=tenant.ns_id,
            tokens=tuple(tokens), sampling=wire.Sampling(max_tokens=1), deadline=deadline,
            hop_budget=2, visited=(entry,),
            trace=(wire.Hop(peer=entry, action="forward", reason="test",
                            next_peer=router.identity.peer_id),),
            holders=holders))
        async with Client.connect(router.full_addrs()[0]) as c:
            stream = await c.host.open_stream(c.peer, wire.INFER_PROTOCOL, 5.0)
            fs = FramedStream(stream, timeout_s=10.0)
            await fs.send(req)
            final = None
            while not isinstance(frame := await fs.receive(), wire.End):
                assert not isinstance(frame, wire.Error), frame
                final = frame if isinstance(frame, wire.Final) else final
            await fs.close()
        return final

    async def main():
        async with trio.open_nursery() as nursery:
            nodes = await _partitioned_swarm(nursery, tmp_path, 5)
            holder = nodes[0]
            hid = holder.identity.peer_id
            messages = [("system", SYSTEM), ("user", "x")]
            async with Client.connect(holder.full_addrs()[0]) as c:
                await c.ask(messages, max_tokens=1, hop_budget=0)
            await _wait_for(lambda: len(holder.pd.streams) == 1)
            (p,) = holder.pd.streams
            homes = holder.pd.homes(p, holder.exchange.members())
            router = next(nd for nd in nodes if nd.identity.peer_id not in homes
                          and nd is not holder)
            tenant = next(iter(router.tenants))
            tokens = await router.backend.tokenize(messages)
            chain = chain_hashes(tenant.namespace_key, tokens, BLOCK_TOKENS)
            home = next(nd for nd in nodes if nd.identity.peer_id in homes and nd is not holder)
            await _wait_for(lambda: any(h.peer == hid for h in home.pd.lookup(p, tenant.ns_id, chain)))
            holders = tuple((h.peer, h.blocks) for h in home.pd.lookup(p, tenant.ns_id, chain))

            final = await forwarded(router, messages, holders)
            assert final.serving == hid and final.cached_tokens > 0, final.hops
            rid = router.identity.peer_id
            assert [(h.peer, h.action) for h in final.hops[1:]] == [
                (rid, "forward"), (hid, "serve")]
            assert router.infer.stats.get("partition_carried_decisions") == 1
            assert router.infer.stats.get("partition_lookups") is None, router.infer.stats

            await trio.sleep(1.0)  # heartbeats report the holder idle again
            final = await forwarded(router, messages, ())
            assert final.serving == rid and final.cached_tokens == 0, final.hops
            assert router.infer.stats.get("partition_carried_decisions") == 1
            for nd in nodes:
                await nd.shutdown(grace_s=0.1)

    trio.run(main)


T1_SECRET = "partition-relay-test-secret-0123456789"


def test_a_node_without_the_namespace_relays_to_a_holder_its_partitions_know(tmp_path):
    """Partitioned digests leave the full index empty, so a node not configured for a
    request's namespace (it cannot compute the namespace's chains) relays by what the
    partitions it homes know: here it is a home of the prompt's partition, learns the
    holder from the holder's push, and relays the request there."""
    from prefixmesh.inference.core.blocks import BLOCK_TOKENS, chain_hashes  # noqa: PLC0415
    from prefixmesh.node.client import Client  # noqa: PLC0415
    from prefixmesh.node.config import load_config  # noqa: PLC0415

    with_t1 = f'[tenants.public]\nvisibility = "public"\n[tenants.t1]\nsecret = "{T1_SECRET}"\n'
    without = '[tenants.public]\nvisibility = "public"\n'
    t1 = load_config(text=with_t1).tenant("t1")

    async def main():
        async with trio.open_nursery() as nursery:
            nodes = await _partitioned_swarm(nursery, tmp_path, 5, [with_t1] * 4 + [without])
            holder, relay = nodes[0], nodes[4]
            ns_tenant = next(t for t in holder.tenants if t.name == "t1")
            members = holder.exchange.members()
            # a prompt whose partition the relay node is a home of
            for i in range(200):
                # (the partition key is the 4th block: vary the start)
                messages = [("system", f"Variant {i}. {SYSTEM}"), ("user", "question")]
                tokens = await holder.backend.tokenize(messages)
                chain = chain_hashes(ns_tenant.namespace_key, tokens, BLOCK_TOKENS)
                p = holder.pd.partition(ns_tenant.ns_id, chain)
                if relay.identity.peer_id in holder.pd.homes(p, members):
                    break
            else:
                raise AssertionError("no prompt homed at the relay node")
            async with Client.connect(holder.full_addrs()[0]) as c:
                await c.ask(messages, tenant=t1, max_tokens=1, hop_budget=0)
            hid = holder.identity.peer_id
            await _wait_for(lambda: hid in relay.pd.namespace_holders(ns_tenant.ns_id))
            assert relay.index.estimate(hid) is None or \
                not relay.index.holds_namespace(hid, ns_tenant.ns_id)  # no full index
            async with Client.connect(relay.full_addrs()[0]) as c:
                ans = await c.ask(messages, tenant=t1, max_tokens=1)
            assert ans.final.serving == hid and ans.final.cached_tokens > 0, ans.final.hops
            assert ans.final.hops[0].peer == relay.identity.peer_id
            assert ans.final.hops[0].reason.startswith("relay"), ans.final.hops
            for nd in nodes:
                await nd.shutdown(grace_s=0.1)

    trio.run(main)
