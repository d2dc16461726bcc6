"""Real node processes on 127.0.0.1 with the real default model: digests spread, peers are
discovered through gossip, and requests are forwarded to the node holding their prefix."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from _swarm import Swarm, ask, peers, wait_until  # noqa: E402

pytestmark = pytest.mark.slow

SHARED = (
    "You are a meticulous assistant for a library catalogue. Always answer in one short "
    "sentence. The catalogue holds books about astronomy, botany, chemistry, geology, "
    "history, linguistics, mathematics, music theory, oceanography and zoology. "
) * 6


def _prompt(question: str, system: str = SHARED):
    return [("system", system), ("user", question)]


def _seen_idle(entry, holder) -> None:
    """Wait until the entry's view of the holder's load (heartbeat PONGs) shows it idle
    again after the previous request (load figures steer routing too)."""

    def idle() -> bool:
        info = {p.peer: p for p in peers(entry.addr).peers}.get(holder.peer_id)
        return info is not None and info.up and info.active == 0 and info.queue_depth == 0

    wait_until(idle, timeout_s=10, interval_s=0.2, what=f"{entry.name} to see {holder.name} idle")


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    root = tmp_path_factory.mktemp("swarm")
    with Swarm(root) as s:
        a = s.add("A")
        s.add_many("BCD", bootstrap=[a.addr])  # D knows only A
        yield s


def test_digests_reach_every_node_and_gossip_finds_peers(swarm):
    a, b, c, d = swarm.nodes
    # every node caches something of its own (hop budget 0: served where it is asked); the
    # four asks go at once, each to its own node process (their prefills overlap on the cores)
    with ThreadPoolExecutor(len(swarm.nodes)) as pool:
        answers = list(pool.map(
            lambda node: ask(node.addr, _prompt(f"Name one book for node {node.name}."),
                             max_tokens=4, hop_budget=0), swarm.nodes))
    for node, ans in zip(swarm.nodes, answers, strict=True):
        assert ans.final.serving == node.peer_id
    ids = {n.peer_id for n in swarm.nodes}

    def everyone_knows_everyone():
        for node in swarm.nodes:
            reply = peers(node.addr)
            known = {p.peer: p for p in reply.peers if p.n_hashes > 0}
            if set(known) != ids - {node.peer_id}:
                return False
        return True

    wait_until(everyone_knows_everyone, timeout_s=30, what="every index to hold every peer")
    # D was configured with A only: it learned B and C from gossip (or the DHT)
    reply = peers(d.addr)
    by_peer = {p.peer: p for p in reply.peers}
    for other in (b, c):
        info = by_peer[other.peer_id]
        assert "bootstrap" not in info.sources, info
        assert set(info.sources) & {"gossip", "dht"}, info
        assert info.up
    assert "bootstrap" in by_peer[a.peer_id].sources
    assert reply.stats.get("digest_records_applied", 0) >= 3


def test_request_forwarded_to_the_node_holding_its_prefix(swarm):
    a, b = swarm.nodes[0], swarm.nodes[1]
    # a prefix no node holds yet (A cached SHARED in the previous test)
    long_system = (
        "Rules of the reading room: whisper, return books to the trolley, never eat near "
        "the manuscripts, ask the librarian before photocopying, and cite shelf numbers. "
    ) * 6
    before = {p.peer: p for p in peers(a.addr).peers}[b.peer_id].n_hashes
    first = ask(b.addr, _prompt("Which shelf holds botany?", long_system), max_tokens=4,
                hop_budget=0)
    assert first.final.serving == b.peer_id

    def a_knows_b_holds_it():
        info = {p.peer: p for p in peers(a.addr).peers}.get(b.peer_id)
        return info is not None and info.n_hashes >= before + first.final.prompt_tokens // 16 - 1

    wait_until(a_knows_b_holds_it, timeout_s=20, what="A to learn B's new prefix")
    _seen_idle(a, b)
    second = ask(a.addr, _prompt("Which shelf holds geology?", long_system), max_tokens=4)
    fin = second.final
    assert fin.serving == b.peer_id, [h.reason for h in fin.hops]
    assert fin.entry == a.peer_id
    assert fin.cached_tokens > 0
    assert fin.cached_tokens >= fin.prompt_tokens // 2
    assert [h.action for h in fin.hops] == ["forward", "serve"]
    assert fin.hops[0].peer == a.peer_id and fin.hops[0].next_peer == b.peer_id
    assert fin.hops[0].reason.startswith("prefixmesh: forward")
    assert fin.hops[0].ttft_ms >= fin.hops[1].ttft_ms > 0
    assert second.text


def test_without_digests_the_same_request_is_served_cold_at_the_entry(tmp_path):
    with Swarm(tmp_path) as s:
        a = s.add("A", digest=False)
        b = s.add("B", bootstrap=[a.addr], digest=False)
        first = ask(b.addr, _prompt("Which shelf holds music theory?"), max_tokens=4, hop_budget=0)
        assert first.final.serving == b.peer_id
        wait_until(lambda: any(p.peer == b.peer_id and p.up for p in peers(a.addr).peers),
                   timeout_s=15, what="A to see B up")
        second = ask(a.addr, _prompt("Which shelf holds zoology?"), max_tokens=4)
        assert second.final.serving == a.peer_id
        assert second.final.cached_tokens == 0
        assert [h.action for h in second.final.hops] == ["serve"]
        assert peers(a.addr).peers[0].n_hashes == 0
