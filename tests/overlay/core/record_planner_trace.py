"""Record decision inputs from a real swarm, for the planner differential test.

    .venv/bin/python tests/overlay/core/record_planner_trace.py [OUT.json]

Runs four full nodes (``node.daemon.Node``: real py-libp2p hosts on loopback, digests,
heartbeats, the one planner) in one process with the simulated engine (different prefill
rates, real time per token so queues form), sends 64 requests with shared system
prompts to random entry nodes, a few at a time, and records at every routing decision
what the planner saw: the request's size and the local match, this node's load, every
up peer's RTT, its matched blocks in the cache view and its digest load figures, and
the plan the node took. ``tests/overlay/core/test_planner_differential.py`` replays
each record through both bodies' input builders (node and simulator) and requires
identical plans. Written to ``planner_trace.json`` next to this script by default.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import trio

from prefixmesh.inference.backend import SimulatedBackend
from prefixmesh.inference.core.blocks import BLOCK_TOKENS
from prefixmesh.node.client import Client
from prefixmesh.node.config import load_config
from prefixmesh.node.daemon import Node, NodeOptions
from prefixmesh.overlay.core.identity import Identity

SUBJECTS = ["astronomy", "anatomy", "law", "chemistry"]
TPS = [300.0, 420.0, 900.0, 420.0]


def _recorder(node: Node, out: list[dict]):
    """Wrap the node's planner call to note its inputs and its plan (nothing changes)."""
    planned = node.infer._planned

    def record(inp):
        plan = planned(inp)
        if plan.__class__.__name__ not in ("Serve", "Forward") or inp.answer is not None:
            return plan
        view = node.infer.planner.view
        matches = view.known(inp.ns, inp.chain, node.infer.clock()).matches or {}
        rtts = [link.rtt_s for link in inp.peers.values() if link.rtt_s is not None]
        peers = []
        for peer in sorted(inp.peers):
            load = view.load_of(peer)
            peers.append([int(matches.get(peer, 0)),
                          int(load.queue_depth) if load else 0, int(load.active) if load else 0,
                          float(load.prefill_tps) if load else 0.0, load is not None])
        out.append({
            "node": node.identity.peer_id_b58[-8:],
            "prompt_blocks": inp.prompt_tokens // BLOCK_TOKENS,
            "local_blocks": inp.local_matched_tokens // BLOCK_TOKENS,
            "busy": inp.local_load > 0,
            "svc_mean": round(inp.avg_request_s, 4),
            "delay_ms": round(statistics.median(rtts) * 1000.0 / 2, 3) if rtts else 1.0,
            "peers": peers,
            "plan": plan.__class__.__name__,
            "reason": plan.reason,
        })
        return plan

    node.infer._planned = record


async def _run(root: Path, out: list[dict]) -> None:
    rng = random.Random(7)
    async with trio.open_nursery() as nursery:
        nodes: list[Node] = []
        for i, tps in enumerate(TPS):
            overrides = {
                "node.cache_dir": str(root / f"n{i}"), "node.mdns": False,
                "node.key_file": str(root / f"n{i}.key"),
                "node.bootstrap": [nodes[0].full_addrs()[0]] if nodes else None,
                "digest.interval_s": 0.3,
            }
            node = Node(load_config(None, overrides),
                        NodeOptions(backend="sim", dht=False, print_addrs=False, seed=i,
                                    heartbeat_interval_s=0.3, heartbeat_timeout_s=1.0),
                        identity=Identity.generate(),
                        backend=SimulatedBackend(prefill_tps=tps, decode_tps=200.0))
            await nursery.start(node.run)
            _recorder(node, out)
            nodes.append(node)
        await trio.sleep(3.0)  # heartbeats up, first digests

        async def one(k: int) -> None:
            subject = rng.choice(SUBJECTS)
            entry = rng.choice(nodes)
            system = f"The following are multiple choice questions about {subject}. " * 12
            async with Client.connect(entry.full_addrs()[0]) as c:
                await c.ask([("system", system), ("user", f"question {k}?")], max_tokens=8)

        for k in range(0, 64, 4):
            async with trio.open_nursery() as burst:
                for j in range(4):
                    burst.start_soon(one, k + j)
            await trio.sleep(0.4)  # digests move between bursts
        for n in nodes:
            await n.shutdown(grace_s=0.2)
        nursery.cancel_scope.cancel()


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name(
        "planner_trace.json")
    out: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        trio.run(_run, Path(tmp), out)
    path.write_text(json.dumps({"recorded_with": __doc__.split("\n\n")[1].strip(),
                                "decisions": out}, indent=1) + "\n")
    kinds = {k: sum(1 for d in out if d["plan"] == k) for k in ("Serve", "Forward")}
    print(f"{len(out)} decisions recorded to {path}: {kinds}")


if __name__ == "__main__":
    main()
