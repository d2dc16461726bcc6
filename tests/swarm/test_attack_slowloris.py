"""Issue 14, finding 2, against a real node process (``--backend sim``, partitioned digests
on so every protocol is served): outside attackers (tests/adversary/slowloris.py, plain
py-libp2p + Noise, fresh identities) trickle one byte every 2 s into streams announcing
512 KiB frames, on every protocol the node serves (infer, digest, partition, peers, and
membership: swim, the default), reopening
each stream the victim cuts; a second test floods infer streams from many identities.
Meanwhile an honest client sends 20 sequential requests, each on a new connection (a new
identity: no history with the victim). Asserted: every honest request is answered, the
node cuts the trickled streams (whole-frame deadlines) rather than holding them, a
peers query is answered after the attack, and the node is alive. Latency figures are
the benchmark's (bench/attack_slowloris.py; docs/SECURITY.md D20)."""

from __future__ import annotations

import trio
from _swarm import Swarm
from adversary.slowloris import PROTOCOLS, slowloris

from prefixmesh.node.client import Client

N_REQUESTS = 20


async def _honest(addr: str) -> None:
    async with Client.connect(addr) as c:  # a fresh connection (and identity) each time
        answer = await c.ask([("user", "hello")], max_tokens=2)
    assert answer.final is not None and answer.final.serving is not None


def _run_attack(a, attacks: list[tuple[object, dict]]) -> dict:
    """Run ``slowloris`` against each (node, arguments) at once while the honest client
    asks ``a``; then a peers query and a request at every attacked node. The attack ends
    once the honest requests are done and every protocol's trickle was cut at least once
    (what the tests assert), or at its ``duration_s``, whichever comes first."""
    async def main():
        out = {"attack": {}}
        stop, live, ended = trio.Event(), {}, []
        async with trio.open_nursery() as nursery:
            events = []
            for node, attack in attacks:
                started = trio.Event()
                events.append(started)

                async def attack_task(node=node, attack=attack, started=started):
                    figs = await slowloris(node.addr, started=started, stop=stop, live=live,
                                           **attack)
                    out["attack"].update(figs)
                    ended.append(node)

                nursery.start_soon(attack_task)
            for started in events:
                await started.wait()
            await trio.sleep(3.0)  # let the attack take hold
            for _ in range(N_REQUESTS):
                await _honest(a.addr)
            out["honest"] = N_REQUESTS
            while len(ended) < len(attacks) and not all(fig.cut for fig in live.values()):
                await trio.sleep(0.2)  # the attacks end at their duration at the latest
            stop.set()
        for node, _ in attacks:  # after the attack: peers + a request
            async with Client.connect(node.addr) as c:
                reply = await c.peers()
                assert reply.self_peer == node.peer_id
            await _honest(node.addr)
        return out

    return trio.run(main)


def test_slowloris_on_every_protocol(tmp_path):
    with Swarm(tmp_path) as s:
        a = s.add("A", backend="sim")  # full digests: infer, digest, peers, swim
        cfg = tmp_path / "b.toml"
        cfg.write_text("[digest]\npartitions = 2\n")  # partitioned digests instead
        b = s.add("B", backend="sim", extra=["--config", str(cfg)])
        common = {"identities": 3, "streams": 8, "duration_s": 24.0}
        out = _run_attack(a, [(a, {"protocols": ["infer", "digest", "peers", "swim"], **common}),
                              (b, {"protocols": ["partition"], **common})])
        print("slowloris figures:", out)
        assert out["honest"] == N_REQUESTS
        # every protocol a default node serves ("ping" is the heartbeat's, not served here)
        assert set(out["attack"]) == set(PROTOCOLS) - {"ping"}
        for name, fig in out["attack"].items():
            # each protocol's trickled streams were cut by the victim, not held
            assert fig["cut"] >= 1, (name, fig, s.logs())
        for node in (a, b):
            assert node.proc.poll() is None, node.log_tail()
            assert "internal error" not in node.log_tail(20000)


def test_infer_stream_flood_from_many_identities(tmp_path):
    with Swarm(tmp_path) as s:
        a = s.add("A", backend="sim")
        # 8 identities x 64 trickled infer streams: more than every slot of the node
        out = _run_attack(a, [(a, {"protocols": ["infer"], "identities": 8, "streams": 64,
                                   "gap_s": 5.0, "duration_s": 24.0})])
        print("infer stream flood figures:", out)
        assert out["honest"] == N_REQUESTS
        assert out["attack"]["infer"]["cut"] >= 1, out
        assert a.proc.poll() is None, a.log_tail()
