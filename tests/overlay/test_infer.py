"""In-process overlay tests (real libp2p on loopback, simulated engine: fast, no model):
forwarding and traces, fallbacks, deadlines, digest expiry, and the resume filter."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import trio
from _fault_node import LieDigestBackend
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.inference.backend import BackendOverloaded, SimulatedBackend
from prefixmesh.node.client import Client, RequestFailed
from prefixmesh.node.config import load_config
from prefixmesh.node.daemon import Node, NodeOptions
from prefixmesh.overlay.core import wire
from prefixmesh.overlay.core.identity import Identity
from prefixmesh.overlay.core.limits import ForwardShareLimiter
from prefixmesh.overlay.forwarding import Diverged as _Diverged
from prefixmesh.overlay.forwarding import Relay as _Relay

SYSTEM = "a long shared system prompt about routing requests to cached prefixes. " * 10


async def _start(nursery, tmp_path, n, *, tps=(400.0,), ttl=60.0, refresh=20.0, backends=None,
                 options=None):
    nodes = []
    for i in range(n):
        overrides = {
            "node.cache_dir": str(tmp_path / f"n{i}"), "node.mdns": False,
            "node.key_file": str(tmp_path / f"n{i}.key"),
            "node.bootstrap": [nodes[0].full_addrs()[0]] if nodes else None,
            "digest.interval_s": 0.3, "digest.ttl_s": ttl, "digest.refresh_interval_s": refresh,
        }
        backend = backends[i] if backends else SimulatedBackend(prefill_tps=tps[i % len(tps)])
        node = Node(load_config(None, overrides),
                    NodeOptions(backend="sim", dht=False, print_addrs=False, seed=i,
                                heartbeat_interval_s=0.3, heartbeat_timeout_s=1.0,
                                **(options[i] if options else {})),
                    identity=Identity.generate(), backend=backend)
        await nursery.start(node.run)
        nodes.append(node)
    return nodes


async def _wait(predicate, timeout=15.0):
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.05)


def _knows(observer: Node, origin: Node) -> bool:
    est = observer.index.estimate(origin.identity.peer_id)
    return est is not None and est.n_hashes > 0 and observer.heartbeat.is_up(origin.identity.peer_id)


async def _shutdown(nodes):
    for n in nodes:
        await n.shutdown(grace_s=0.2)


def test_forwarding_trace_and_fallback(tmp_path):
    async def main():
        async with trio.open_nursery() as nursery:
            a, b, c = await _start(nursery, tmp_path, 3)
            async with Client.connect(b.full_addrs()[0]) as cb:
                await cb.ask([("system", SYSTEM), ("user", "x")], max_tokens=2, hop_budget=0)
            async with Client.connect(c.full_addrs()[0]) as cc:
                await cc.ask([("system", SYSTEM), ("user", "y")], max_tokens=2, hop_budget=0)
            await _wait(lambda: _knows(a, b) and _knows(a, c))
            async with Client.connect(a.full_addrs()[0]) as ca:
                ans = await ca.ask([("system", SYSTEM), ("user", "z")], max_tokens=3)
                first = ans.final.serving
                assert first in (b.identity.peer_id, c.identity.peer_id)
                assert ans.final.cached_tokens > 0
                assert [h.action for h in ans.final.hops] == ["forward", "serve"]
                assert ans.final.hops[0].next_peer == first
                assert ans.final.entry == a.identity.peer_id
                # A checked the claim against the FINAL frame: honoured, trust went up
                record = a.infer.trust.record(first)
                assert record is not None and record.honoured == 1
                # both holders now refuse work (retryable): A tries one, then the other
                # (the policy lists it as a fallback), then serves itself

                async def refuse(request):
                    raise BackendOverloaded("queue full (test)")
                    yield  # pragma: no cover

                b.backend.generate = refuse
                c.backend.generate = refuse
                # let heartbeats report the finished request's load as gone (the policy's
                # bounded-load rule would otherwise drop the busy node from the fallbacks)
                await trio.sleep(1.0)
                ans2 = await ca.ask([("system", SYSTEM), ("user", "w")], max_tokens=3)
                assert ans2.final.serving == a.identity.peer_id
                hops = ans2.final.hops
                assert [h.action for h in hops] == ["fallback", "fallback", "serve"], hops
                assert {hops[0].next_peer, hops[1].next_peer} == {b.identity.peer_id, c.identity.peer_id}
                assert all("overloaded" in h.reason for h in hops[:2])
                assert hops[2].reason.startswith("fallback: 2 forward(s) failed")
                assert a.infer.stats["fallbacks"] == 2
                assert a.infer.trust.record(b.identity.peer_id).failures == 1
                assert a.infer.trust.record(c.identity.peer_id).failures == 1
            await _shutdown([a, b, c])

    trio.run(main)


def test_a_relaying_liar_is_charged_for_what_its_relay_delivered(tmp_path):
    """D advertises all of a long prompt (tests/_fault_node.py's LieDigestBackend) and holds none of
    it; B really holds its system part. A forwards to D for the long claim, D relays to B
    (its best holder), B reuses only the system part: A charges the shortfall to D, its
    next hop, although D did not serve. Otherwise a liar that relays what it attracts
    would never lose trust."""
    doc = "a long user document about lighthouses, storms, maps and distant islands. " * 12
    prompt = (("system", SYSTEM), ("user", doc))

    async def main():
        async with trio.open_nursery() as nursery:
            liar = LieDigestBackend(SimulatedBackend(prefill_tps=400.0), [prompt])
            a, b, d = await _start(nursery, tmp_path, 3, backends=[
                SimulatedBackend(prefill_tps=400.0), SimulatedBackend(prefill_tps=400.0), liar])
            async with Client.connect(b.full_addrs()[0]) as cb:
                await cb.ask([("system", SYSTEM), ("user", "x")], max_tokens=1, hop_budget=0)
            await _wait(lambda: _knows(a, b) and _knows(a, d) and _knows(d, b))
            async with Client.connect(a.full_addrs()[0]) as ca:
                ans = await ca.ask(list(prompt), max_tokens=1)
            pa, pb, pd = (n.identity.peer_id for n in (a, b, d))
            hops = ans.final.hops
            assert [(h.peer, h.action, h.next_peer) for h in hops[:2]] == [
                (pa, "forward", pd), (pd, "forward", pb)], hops
            assert ans.final.serving == pb
            # B reused the system part only: well under 90 % of what D claimed
            assert 0 < ans.final.cached_tokens < 0.9 * ans.final.prompt_tokens
            rec = a.infer.trust.record(pd)
            assert rec is not None and rec.misses == 1 and rec.honoured == 0
            assert rec.trust < 0.8  # TrustConfig.initial: the miss was charged
            assert a.infer.trust.record(pb) is None  # A never forwarded to B itself
            await _shutdown([a, b, d])

    trio.run(main)


def test_forward_share_cap(tmp_path):
    async def main():
        async with trio.open_nursery() as nursery:
            a, b = await _start(nursery, tmp_path, 2)
            a.infer.share_limiter = ForwardShareLimiter(max_share=0.5, window=4, min_count=2)
            async with Client.connect(b.full_addrs()[0]) as cb:
                await cb.ask([("system", SYSTEM), ("user", "x")], max_tokens=1, hop_budget=0)
            await _wait(lambda: _knows(a, b))
            async with Client.connect(a.full_addrs()[0]) as ca:
                first = await ca.ask([("system", SYSTEM), ("user", "1")], max_tokens=1)
                assert first.final.serving == b.identity.peer_id
                # B would now hold 2 of 2 forwards > half: over the cap, A serves itself
                second = await ca.ask([("system", SYSTEM), ("user", "2")], max_tokens=1)
                assert second.final.serving == a.identity.peer_id
            await _shutdown([a, b])

    trio.run(main)


def test_deadline_expires_with_error_frame(tmp_path):
    async def main():
        async with trio.open_nursery() as nursery:
            (a,) = await _start(nursery, tmp_path, 1, tps=(50.0,))  # ~15 s of "prefill"
            async with Client.connect(a.full_addrs()[0]) as ca:
                t0 = time.monotonic()
                with pytest.raises(RequestFailed) as info:
                    await ca.ask([("system", SYSTEM), ("user", "slow")], max_tokens=2,
                                 deadline_s=1.0)
                assert info.value.code == "deadline"
                assert time.monotonic() - t0 < 3.0
            await _shutdown([a])

    trio.run(main)


def test_unknown_namespace_and_duplicate_ids_are_refused(tmp_path):
    async def main():
        async with trio.open_nursery() as nursery:
            (a,) = await _start(nursery, tmp_path, 1)
            async with Client.connect(a.full_addrs()[0]) as ca:
                stream = await ca.host.open_stream(a.identity.peer_id, wire.INFER_PROTOCOL)
                from prefixmesh.overlay.host import FramedStream

                fs = FramedStream(stream)
                await fs.send(wire.Request(id=b"1" * 16, ns=b"?" * 8, tokens=(1, 2, 3),
                                           deadline=time.time() + 10))
                err = await fs.receive()
                # from a client (no trace), a namespace nobody serves is a wrong secret
                assert isinstance(err, wire.Error) and err.code == "unauthorized", err
                tenant = await ca.tenant()
                rid, deadline = b"2" * 16, time.time() + 10
                req = tenant.sign(wire.Request(id=rid, ns=tenant.ns_id,
                                               tokens=tuple(range(40)), deadline=deadline,
                                               sampling=wire.Sampling(max_tokens=1)))
                for expected in (wire.Tokens, wire.Error):
                    fs = FramedStream(await ca.host.open_stream(a.identity.peer_id, wire.INFER_PROTOCOL))
                    await fs.send(req)
                    frame = await fs.receive()
                    assert isinstance(frame, expected), frame
                    await fs.close()
                assert frame.code == "duplicate" and "already handled" in frame.message
            await _shutdown([a])

    trio.run(main)


def test_silent_peer_expires_from_indexes(tmp_path):
    async def main():
        async with trio.open_nursery() as nursery:
            a, b = await _start(nursery, tmp_path, 2, ttl=2.0, refresh=0.5)
            async with Client.connect(b.full_addrs()[0]) as cb:
                await cb.ask([("system", SYSTEM), ("user", "x")], max_tokens=1, hop_budget=0)
            await _wait(lambda: _knows(a, b))
            await b.shutdown(grace_s=0.1)
            await _wait(lambda: a.index.estimate(b.identity.peer_id) is None, timeout=10)
            await _shutdown([a])

    trio.run(main)


def test_relay_resume_filter():
    sent = []

    async def main():
        async def emit(frame):
            sent.append(frame)

        relay = _Relay(emit)
        await relay.tokens(wire.Tokens("Hello"))
        await relay.tokens(wire.Tokens(" wor"))
        relay.replay = ""  # a replacement source starts from the beginning
        for piece in ("Hel", "lo w", "orld", "!"):
            await relay.tokens(wire.Tokens(piece))
        assert "".join(f.text for f in sent) == "Hello world!"
        relay.replay = ""
        with pytest.raises(_Diverged):
            await relay.tokens(wire.Tokens("Help"))

    trio.run(main)


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=60), st.data())
def test_relay_resume_filter_property(text, data):
    """Whatever was relayed before a failure, and however the replacement chunks the same
    output, the requester receives exactly the full text once."""
    cut = data.draw(st.integers(0, len(text)))
    bounds = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    sent = []

    async def main():
        async def emit(frame):
            sent.append(frame.text)

        relay = _Relay(emit)
        if cut:
            await relay.tokens(wire.Tokens(text[:cut]))
        relay.replay = ""
        prev = 0
        for b in [*bounds, len(text)]:
            if b > prev:
                await relay.tokens(wire.Tokens(text[prev:b]))
                prev = b

    trio.run(main)
    assert "".join(sent) == text


def test_heartbeats_carry_summary_hashes_and_in_sync_peers_are_skipped(tmp_path):
    async def main():
        async with trio.open_nursery() as nursery:
            nodes = await _start(nursery, tmp_path, 3)
            a = nodes[0]

            def in_sync():
                return all(
                    n.heartbeat.health.get(m.identity.peer_id) is not None
                    and n.heartbeat.health[m.identity.peer_id].summary_hash == n.exchange.advertised_hash()
                    for n in nodes for m in nodes if m is not n
                )

            await _wait(in_sync, timeout=20)
            before = {n: n.exchange.stats["exchanges_ok"] for n in nodes}
            skipped = a.exchange.stats["peers_skipped_in_sync"]
            await trio.sleep(1.0)  # ~3 rounds in sync: peers skipped, (almost) no exchanges
            assert a.exchange.stats["peers_skipped_in_sync"] > skipped
            # a new cached prefix changes B's hash: others see it in PONGs and pull it
            b = nodes[1]
            b.backend.insert_prefix(next(iter(b.tenants)).ns_id, list(range(64)))
            await _wait(lambda: all(_knows(n, b) for n in nodes if n is not b), timeout=10)
            assert sum(n.exchange.stats["exchanges_ok"] - before[n] for n in nodes) >= 1
            await _shutdown(nodes)

    trio.run(main)


async def _raw_request(client: Client, node: Node, req: wire.Request) -> list:
    """Send ``req`` on a fresh stream to ``node``; every frame up to END or ERROR."""
    from prefixmesh.overlay.host import FramedStream

    await client.host.connect(node.identity.peer_id, node.host.listen_addrs(), timeout_s=5.0)
    fs = FramedStream(await client.host.open_stream(node.identity.peer_id, wire.INFER_PROTOCOL))
    await fs.send(req)
    frames = []
    try:
        while True:
            frame = await fs.receive(timeout_s=20.0)
            if frame is None:
                break
            frames.append(frame)
            if isinstance(frame, wire.End | wire.Error):
                break
    finally:
        await fs.close()
    return frames


def test_duplicate_id_at_next_hop_falls_back_instead_of_failing(tmp_path):
    """A resend that reaches a node which already handled the request id (a fallback
    that arrived by another path) is refused as "duplicate" - retryable, so the sender
    tries its next target (here: itself) and the client still gets its answer."""

    async def main():
        async with trio.open_nursery() as nursery:
            a, b = await _start(nursery, tmp_path, 2)
            async with Client.connect(b.full_addrs()[0]) as cb:
                await cb.ask([("system", SYSTEM), ("user", "x")], max_tokens=1, hop_budget=0)
            await _wait(lambda: _knows(a, b))
            async with Client.connect(a.full_addrs()[0]) as ca:
                tenant = await ca.tenant()
                prompt = await a.backend.tokenize([("system", SYSTEM), ("user", "dup")])
                rid, deadline = b"d" * 16, time.time() + 20
                req = tenant.sign(wire.Request(id=rid, ns=tenant.ns_id,
                                               tokens=tuple(prompt), deadline=deadline,
                                               sampling=wire.Sampling(max_tokens=2)))
                # B sees the id first (as if an earlier attempt had reached it)
                first = await _raw_request(ca, b, replace(req, hop_budget=0))
                assert isinstance(first[-1], wire.End)
                again = await _raw_request(ca, b, replace(req, hop_budget=0))
                assert isinstance(again[-1], wire.Error) and again[-1].code == "duplicate"
                # A forwards to B (the holder), B says duplicate, A serves itself
                frames = await _raw_request(ca, a, req)
                final = next(f for f in frames if isinstance(f, wire.Final))
                assert final.serving == a.identity.peer_id
                assert [h.action for h in final.hops] == ["fallback", "serve"], final.hops
                assert "duplicate" in final.hops[0].reason
                assert b.infer.stats["duplicates"] == 2
            await _shutdown([a, b])

    trio.run(main)


def test_per_peer_request_rate_limit(tmp_path):
    """Over its token bucket a peer gets a retryable "overloaded" with a retry hint;
    other peers are not affected."""
    from prefixmesh.overlay.core.limits import PeerRateLimiter

    async def main():
        async with trio.open_nursery() as nursery:
            (a,) = await _start(nursery, tmp_path, 1)
            a.infer._request_limiter = PeerRateLimiter(rate_per_s=0.01, burst=2)
            async with Client.connect(a.full_addrs()[0]) as c1:
                for i in range(2):
                    await c1.ask([("system", SYSTEM), ("user", f"r{i}")], max_tokens=1)
                with pytest.raises(RequestFailed) as info:
                    await c1.ask([("system", SYSTEM), ("user", "r3")], max_tokens=1)
                assert info.value.code == "overloaded" and "rate limit" in info.value.message
            async with Client.connect(a.full_addrs()[0]) as c2:  # another peer id: own bucket
                ans = await c2.ask([("system", SYSTEM), ("user", "other")], max_tokens=1)
                assert ans.final.serving == a.identity.peer_id
            assert a.infer.stats["rate_limited"] == 1
            await _shutdown([a])

    trio.run(main)


def test_inbound_subnet_cap_is_wired_from_the_config(tmp_path):
    """[limits] max_inbound_per_subnet reaches the host's InboundSubnetCap (0: none), and
    the host reclaims a slot from a peer the heartbeat calls down (test_host.py
    shows the cap itself on real connections)."""
    def node(n: int) -> Node:
        cfg = load_config(None, {"node.cache_dir": str(tmp_path / f"c{n}"), "node.mdns": False,
                                 "node.key_file": str(tmp_path / f"k{n}"),
                                 "limits.max_inbound_per_subnet": n})
        return Node(cfg, NodeOptions(backend="sim", dht=False, print_addrs=False),
                    identity=Identity.generate(), backend=SimulatedBackend())

    capped, open_ = node(3), node(0)
    assert capped.host.inbound_cap.max_per_subnet == 3 and open_.host.inbound_cap is None
    assert capped.host.peer_is_down == capped.heartbeat.is_down
    assert "inbound_refused" in capped.stats() and "inbound_refused" not in open_.stats()


def test_subnet_limit_and_router_memory_are_wired(tmp_path):
    """Candidates are capped per subnet by the address of the live connection (loopback
    is exempt by default; the test turns the exemption off), and every decision goes
    through the node's RouterMemory (placements, requests forwarded in)."""
    from prefixmesh.overlay.core.limits import SubnetLimiter

    async def main():
        async with trio.open_nursery() as nursery:
            a, b, c = await _start(nursery, tmp_path, 3)
            for holder in (b, c):
                async with Client.connect(holder.full_addrs()[0]) as ch:
                    await ch.ask([("system", SYSTEM), ("user", "x")], max_tokens=1, hop_budget=0)
            await _wait(lambda: _knows(a, b) and _knows(a, c))
            addrs = a.host.remote_addrs(b.identity.peer_id)
            assert addrs and all(x.startswith("/ip4/127.0.0.1/tcp/") for x in addrs), addrs
            a.infer._subnets = SubnetLimiter(max_per_subnet=1, exempt_loopback=False)
            async with Client.connect(a.full_addrs()[0]) as ca:
                ans = await ca.ask([("system", SYSTEM), ("user", "z")], max_tokens=1)
            # both holders are in 127.0.0.0/24: only one was a candidate
            assert a.infer.stats["subnet_limited"] >= 1
            assert ans.final.serving in (b.identity.peer_id, c.identity.peer_id)
            serving = b if ans.final.serving == b.identity.peer_id else c
            now = time.time()  # the service's one clock
            assert a.infer.memory.enabled
            assert a.infer.memory.placements.recent(ans.final.serving, now) > 0.5
            assert serving.infer.memory.placements.inbound(now) > 0.5  # counted on arrival
            assert a.infer.memory.placements.inbound(now) == 0.0  # came from a client
            await _shutdown([a, b, c])

    trio.run(main)


def test_slow_peer_is_abandoned_after_its_patience_and_served_elsewhere(tmp_path):
    """A holder that is up (heartbeats fine) but far slower than it advertises: the
    forwarder waits its patience (factor x the estimate, at least the floor), records a
    fallback and a trust failure, and serves the request itself well within the deadline."""

    async def main():
        async with trio.open_nursery() as nursery:
            a, b = await _start(nursery, tmp_path, 2)
            async with Client.connect(b.full_addrs()[0]) as cb:
                await cb.ask([("system", SYSTEM), ("user", "x")], max_tokens=1, hop_budget=0)
            await _wait(lambda: _knows(a, b))
            a.infer.settings.first_frame_floor_s = 0.5
            real_generate = b.backend.generate

            async def slow(request):
                await trio.sleep(20.0)  # far beyond any estimate
                async for ev in real_generate(request):
                    yield ev

            b.backend.generate = slow
            async with Client.connect(a.full_addrs()[0]) as ca:
                t0 = time.monotonic()
                ans = await ca.ask([("system", SYSTEM), ("user", "slow")], max_tokens=2,
                                   deadline_s=30.0)
                waited = time.monotonic() - t0
            hops = ans.final.hops
            assert ans.final.serving == a.identity.peer_id
            assert [h.action for h in hops] == ["fallback", "serve"], hops
            assert hops[0].next_peer == b.identity.peer_id and "patience" in hops[0].reason
            assert a.infer.trust.record(b.identity.peer_id).failures == 1
            assert waited < 20.0  # abandoned before the slow peer would have answered
            await _shutdown([a, b])

    trio.run(main)


def test_peer_without_the_namespace_is_retried_around_and_remembered(tmp_path, monkeypatch):
    """Digests only list namespaces a peer has cached something in, so a policy may pick
    a peer that does not serve the tenant (here: round-robin at A). Its "unknown_namespace"
    is retryable: A serves the request itself, costs the peer no trust, and does not
    offer that peer the namespace again for a while."""
    from prefixmesh.bench.policies import make_policy
    from prefixmesh.node import daemon
    from prefixmesh.node.tenants import TenantSpec

    async def main():
        async with trio.open_nursery() as nursery:
            team = ('[tenants.team]\nsecret = "0123456789abcdef0123"\n'
                    '[tenants.public]\nvisibility = "public"\n')
            nodes = []
            for i, text in enumerate((team, "")):
                overrides = {
                    "node.cache_dir": str(tmp_path / f"n{i}"), "node.mdns": False,
                    "node.key_file": str(tmp_path / f"n{i}.key"),
                    "node.bootstrap": [nodes[0].full_addrs()[0]] if nodes else None,
                    "digest.interval_s": 0.3,
                }
                with monkeypatch.context() as m:
                    if i == 0:  # A routes round-robin: a baseline, as bench/node_entry.py does
                        m.setattr(daemon, "make_policy", lambda _n, config, rng, me:
                                  make_policy("round-robin", config, rng, me))
                    node = Node(load_config(None, overrides, text=text),
                                NodeOptions(backend="sim", dht=False, print_addrs=False, seed=i,
                                            heartbeat_interval_s=0.3, heartbeat_timeout_s=1.0),
                                identity=Identity.generate(),
                                backend=SimulatedBackend(prefill_tps=400.0))
                await nursery.start(node.run)
                nodes.append(node)
            a, b = nodes
            await _wait(lambda: a.heartbeat.is_up(b.identity.peer_id)
                        and a.index.estimate(b.identity.peer_id) is not None)
            spec = TenantSpec(name="team", secret=b"0123456789abcdef0123")
            async with Client.connect(a.full_addrs()[0]) as ca:
                answers = [await ca.ask([("user", f"q{i}")], tenant=spec, max_tokens=1)
                           for i in range(4)]
            assert all(ans.final.serving == a.identity.peer_id for ans in answers)
            tried_b = [ans for ans in answers if ans.final.hops[0].action == "fallback"]
            assert len(tried_b) == 1, [[h.action for h in x.final.hops] for x in answers]
            assert "unknown_namespace" in tried_b[0].final.hops[0].reason
            assert a.infer.routes.is_not_serving(b.identity.peer_id, a.tenants.by_name("team").ns_id)
            record = a.infer.trust.record(b.identity.peer_id)
            assert record is None or record.failures == 0
            await _shutdown([a, b])

    trio.run(main)


class _Recorder:
    """An InferObserver that keeps every event (overlay/events.py)."""

    def __init__(self):
        self.started: list[tuple[bytes, bool]] = []
        self.done: list = []
        self.forwards: list[tuple[str, str]] = []
        self.fallbacks: list[str] = []

    def request_started(self, request_id, entry):
        self.started.append((request_id, entry))

    def request_done(self, event):
        self.done.append(event)

    def forwarded(self, decision, reason):
        self.forwards.append((decision, reason))

    def fallback(self, reason):
        self.fallbacks.append(reason)


def test_observer_hears_one_event_per_request_on_every_node(tmp_path):
    """Entry and serving node each report the request once (entry or forwarded, what they
    did, who served, tokens, times); a rejected request reports its stable error code."""

    async def main():
        async with trio.open_nursery() as nursery:
            a, b = await _start(nursery, tmp_path, 2)
            rec_a, rec_b = _Recorder(), _Recorder()
            a.observers.add(rec_a)
            b.observers.add(rec_b)
            async with Client.connect(b.full_addrs()[0]) as cb:
                await cb.ask([("system", SYSTEM), ("user", "x")], max_tokens=2, hop_budget=0)
            await _wait(lambda: _knows(a, b))
            async with Client.connect(a.full_addrs()[0]) as ca:
                ans = await ca.ask([("system", SYSTEM), ("user", "z")], max_tokens=3)
                assert ans.final.serving == b.identity.peer_id
                stream = await ca.host.open_stream(a.identity.peer_id, wire.INFER_PROTOCOL)
                from prefixmesh.overlay.host import FramedStream

                fs = FramedStream(stream)
                await fs.send(wire.Request(id=b"9" * 16, ns=b"?" * 8, tokens=(1, 2, 3),
                                           deadline=time.time() + 10))
                assert (await fs.receive()).code == "unauthorized"
            await _wait(lambda: len(rec_a.done) == 2 and len(rec_b.done) == 2)
            # b: its own client's request, then the one a forwarded
            assert [e for _, e in rec_b.started] == [True, False]
            fwd_b = rec_b.done[1]
            assert (fwd_b.entry, fwd_b.action, fwd_b.error) == (False, "serve", "")
            assert fwd_b.served_by == b.identity.peer_id and fwd_b.cached_tokens > 0
            # a: the forwarded request, then the rejection
            done = rec_a.done[0]
            assert (done.entry, done.action, done.error) == (True, "forward", "")
            assert done.served_by == b.identity.peer_id
            assert done.prompt_tokens == ans.final.prompt_tokens
            assert done.cached_tokens == ans.final.cached_tokens
            assert done.completion_tokens == ans.final.completion_tokens
            assert 0 <= done.ttft_s <= done.total_s
            assert len(done.route) == 2 and "forward" in done.route[0]
            assert rec_a.forwards and rec_a.forwards[0][0] == "forward"
            assert "forward to" in rec_a.forwards[0][1]
            rejected = rec_a.done[1]
            assert (rejected.action, rejected.error, rejected.served_by) == (
                "reject", "unauthorized", b"")
            assert len(rec_a.started) == 2 and rec_a.fallbacks == []
            await _shutdown([a, b])

    trio.run(main)


def test_prompt_longer_than_the_context_is_refused_before_routing(tmp_path):
    async def main():
        async with trio.open_nursery() as nursery:
            (a,) = await _start(nursery, tmp_path, 1,
                                backends=[SimulatedBackend(context_tokens=64)])
            rec = _Recorder()
            a.observers.add(rec)
            async with Client.connect(a.full_addrs()[0]) as ca:
                with pytest.raises(RequestFailed) as info:
                    await ca.ask([("system", SYSTEM), ("user", "x")], max_tokens=1)
                assert info.value.code == "context_length_exceeded"
                assert "context of 64 tokens" in str(info.value)
                ok = await ca.ask([("user", "hi")], max_tokens=1)  # short prompts still run
                assert ok.final.serving == a.identity.peer_id
            assert [(e.action, e.error) for e in rec.done] == [
                ("reject", "context_length_exceeded"), ("serve", "")]
            await _shutdown([a])

    trio.run(main)
