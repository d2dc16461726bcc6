"""Many models in one mesh, in process (real libp2p on loopback, simulated engines of two
model fingerprints): announcements, the catalog, model relays, no cross-model routing.
The real-model version is tests/swarm/test_two_models.py."""

from __future__ import annotations

import pytest
import trio

from prefixmesh.inference.backend import SimulatedBackend
from prefixmesh.node.client import Client, RequestFailed
from prefixmesh.node.config import load_config
from prefixmesh.node.daemon import Node, NodeOptions
from prefixmesh.node.http_gateway import (
    Finished,
    GatewayApp,
    GatewaySettings,
    GenerationJob,
    NodeGatewayBackend,
)
from prefixmesh.node.openai_schema import BadRequest, SamplingOptions
from prefixmesh.overlay.core import wire
from prefixmesh.overlay.core.identity import Identity, peer_id_to_b58
from prefixmesh.overlay.discovery import mesh_key, providers_key

FP_A, FP_B = b"A" * 16, b"B" * 16
SYSTEM = "a shared system prompt about lighthouses and the ships they guide home. " * 8


async def _start(nursery, tmp_path, fps, *, bootstrap=None, dht=False, membership="swim"):
    nodes = []
    for i, fp in enumerate(fps):
        # default: every earlier node (nodes of one model find each other through the
        # DHT's model key in a real mesh, not through a node of another model)
        boot = nodes if bootstrap is None else [nodes[j] for j in bootstrap[i]]
        overrides = {
            "node.cache_dir": str(tmp_path / f"n{i}"), "node.mdns": False,
            "node.key_file": str(tmp_path / f"n{i}.key"),
            "node.bootstrap": [n.full_addrs()[0] for n in boot] or None,
            "digest.interval_s": 0.3,
        }
        node = Node(load_config(None, overrides),
                    NodeOptions(backend="sim", dht=dht, print_addrs=False, seed=i,
                                heartbeat_interval_s=0.3, heartbeat_timeout_s=1.0,
                                membership=membership),
                    identity=Identity.generate(),
                    backend=SimulatedBackend(prefill_tps=400.0, model_fingerprint=fp))
        await nursery.start(node.run)
        nodes.append(node)
    return nodes


async def _wait(predicate, timeout=15.0):
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.05)


async def _raw_completion(node, prompt: str, model: bytes):
    """A ``/v1/completions`` job through ``node``'s gateway backend, in process."""
    gw = NodeGatewayBackend(infer=node.infer, backend=node.backend, tenants=node.tenants,
                            node=node)
    job = GenerationJob(tenant=node.tenants.names()[0], deadline_s=10.0, prompt=prompt,
                        sampling=SamplingOptions(max_tokens=3, temperature=0.0), model=model)
    async with gw.generation(job) as events:
        return [ev async for ev in events if isinstance(ev, Finished)][0]


def test_mesh_key_is_shared_and_distinct_from_model_keys():
    assert mesh_key() == mesh_key()
    assert mesh_key() not in (providers_key(FP_A), providers_key(FP_B))


def test_two_models_one_mesh(tmp_path):
    async def main():
        async with trio.open_nursery() as nursery:
            a, b1, b2 = await _start(nursery, tmp_path, [FP_A, FP_B, FP_B])
            await _wait(lambda: {e.fingerprint: e.nodes for e in a.models()}
                        == {FP_A: 1, FP_B: 2})
            await _wait(lambda: len(b1.heartbeat.up_peers()) == 2
                        and len(b2.heartbeat.up_peers()) == 2)
            entries = a.models()
            assert entries[0].local and entries[0].fingerprint == FP_A
            # the digest exchange runs only among nodes of one model
            assert a._model_peers() == []
            assert set(b1._model_peers()) == {b2.identity.peer_id}
            async with Client.connect(a.full_addrs()[0]) as ca:
                reply = await ca.peers()
                assert {m.fingerprint: m.nodes for m in reply.models} == {FP_A: 1, FP_B: 2}
                assert {p.model for p in reply.peers} == {FP_B}
                # model B's name and its fingerprint both name it
                name_b = next(m.name for m in reply.models if m.fingerprint == FP_B)
                assert await ca.resolve_model(name_b) == FP_B
                assert await ca.resolve_model(FP_B.hex()) == FP_B
                prompt = [("system", SYSTEM), ("user", "where is the light?")]
                first = await ca.ask(prompt, model=name_b, max_tokens=3)
                assert first.final.serving in (b1.identity.peer_id, b2.identity.peer_id)
                assert first.final.hops[0].peer == a.identity.peer_id
                assert first.final.hops[0].action == "forward"
                assert a.infer.stats["model_relayed"] == 1
                assert a.infer.stats["served_local"] == 0
                second = await ca.ask(prompt, model=name_b, max_tokens=3)
                assert second.final.serving in (b1.identity.peer_id, b2.identity.peer_id)
                assert second.final.cached_tokens > 0
                # model A's own requests stay on A: B nodes are no candidates for them
                own = await ca.ask(prompt, max_tokens=3)
                assert own.final.serving == a.identity.peer_id
                with pytest.raises(RequestFailed) as err:
                    await ca.ask(prompt, model="c" * 32, max_tokens=3)
                assert err.value.code == "unknown_model"
            # a raw-prompt completion for model B, entered at A's gateway: its text goes to
            # a node of B, which tokenizes it (A's tokenizer is A's); the repeat hits B's cache
            raw = [await _raw_completion(a, SYSTEM + "Q: where is the light?", FP_B)
                   for _ in range(2)]
            assert {r.route["serving"] for r in raw} <= {peer_id_to_b58(b1.identity.peer_id),
                                                         peer_id_to_b58(b2.identity.peer_id)}
            assert "model relay" in raw[0].route["hops"][0]["reason"]
            assert raw[0].usage.prompt_tokens == len((SYSTEM + "Q: where is the light?").encode())
            assert raw[1].usage.cached_tokens > 0
            assert a.infer.stats["served_local"] == 1  # only model A's own request above
            # text the wire cannot carry is refused before routing (over MAX_PROMPT_CHARS,
            # or a frame too large in UTF-8); text B's tokenizer finds too long, by B
            for too_long in ("a" * (wire.MAX_PROMPT_CHARS + 1),
                             "\U0001f600" * wire.MAX_PROMPT_CHARS,
                             "\U0001f600" * (wire.MAX_PROMPT_TOKENS // 4 + 1)):
                with pytest.raises(BadRequest) as bad:
                    await _raw_completion(a, too_long, FP_B)
                assert bad.value.code == "context_length_exceeded", bad.value.message
            async with Client.connect(b1.full_addrs()[0]) as cb:
                # B's nodes never send a model-B request to the model-A node
                for i in range(4):
                    ans = await cb.ask([("user", f"question {i}")], max_tokens=2)
                    assert ans.final.serving != a.identity.peer_id
            assert a.backend.load_figures().active == 0
            for n in (a, b1, b2):
                await n.shutdown(grace_s=0.2)

    trio.run(main)


def test_the_dht_mesh_key_finds_nodes_of_other_models(tmp_path):
    """A (model A) is bootstrapped to nobody and only B1 dials it; B2 knows only B1. A
    hears of B2 through nothing but the DHT's mesh-wide key (its own model's key lists
    no B node, and B nodes exchange digests only among themselves). With the all-to-all
    heartbeat: SWIM membership is mesh-wide and would tell A of B2 through B1 (another
    path, tested in tests/overlay/test_swim_swarm.py), so only there is the DHT the only
    path."""
    async def main():
        async with trio.open_nursery() as nursery:
            a, b1, b2 = await _start(nursery, tmp_path, [FP_A, FP_B, FP_B],
                                     bootstrap=[[], [0], [1]], dht=True,
                                     membership="heartbeat")
            await _wait(lambda: {e.fingerprint: e.nodes for e in a.models()}
                        == {FP_A: 1, FP_B: 2}, timeout=45.0)
            # whichever of the two looked the other up first dialled it (the other then
            # knows it from the inbound connection): found through the mesh key either way
            assert ("dht" in a.directory.sources_of(b2.identity.peer_id)
                    or "dht" in b2.directory.sources_of(a.identity.peer_id))
            for n in (a, b1, b2):
                await n.shutdown(grace_s=0.2)

    trio.run(main)


async def _stopped_chat(node, messages, model: bytes, stop_after: int):
    """A chat job through ``node``'s gateway (stop sequences are the gateway's), cut by a
    stop sequence: the word the simulated engine says after ``stop_after`` words. Returns
    the text the client got and the usage it was told."""
    gw = NodeGatewayBackend(infer=node.infer, backend=node.backend, tenants=node.tenants,
                            node=node)
    app = GatewayApp(gw, GatewaySettings())

    def job(stop=()):
        return GenerationJob(tenant=node.tenants.names()[0], deadline_s=10.0,
                             messages=messages, model=model,
                             sampling=SamplingOptions(max_tokens=8, temperature=0.0,
                                                      stop=stop))
    words: list[str] = []
    full = await app._run(job(), _collect(words))
    assert len(words) > stop_after and not full.partial
    parts: list[str] = []
    out = await app._run(job((words[stop_after].strip(),)), _collect(parts))
    assert out.partial and out.finish_reason == "stop"  # cut at the gateway: no FINAL seen
    return "".join(parts), out.usage, full.usage


def _collect(into: list[str]):
    async def on_text(text: str) -> None:
        into.append(text)
    return on_text


def test_a_stop_sequence_keeps_the_serving_nodes_prompt_count(tmp_path):
    """A stop sequence ends a request at the entry gateway before the serving node's FINAL:
    the usage still has the prompt's token count (for another model only its node knows
    it: the serving node says it on its first TOKENS frame) and the cached count."""
    async def main():
        async with trio.open_nursery() as nursery:
            a, b1, b2 = await _start(nursery, tmp_path, [FP_A, FP_B, FP_B])
            await _wait(lambda: {e.fingerprint: e.nodes for e in a.models()}
                        == {FP_A: 1, FP_B: 2})
            await _wait(lambda: len(b1.heartbeat.up_peers()) == 2
                        and len(b2.heartbeat.up_peers()) == 2)
            messages = (("system", SYSTEM), ("user", "which way to the harbour?"))
            b_count = len(await b1.backend.tokenize(messages))
            # model B's chat entered at A: B's node tokenizes, A never knows the count
            text, usage, full = await _stopped_chat(a, messages, FP_B, stop_after=2)
            assert text and usage.completion_tokens >= 2
            assert usage.prompt_tokens == full.prompt_tokens == b_count > 0
            again_text, again, _ = await _stopped_chat(a, messages, FP_B, stop_after=2)
            assert again_text == text
            assert again.prompt_tokens == b_count
            assert again.cached_tokens > 0  # the prefix is cached on B by now
            # model B's chat entered at a B node (tokenized there): the same counts
            _, own, _ = await _stopped_chat(b1, messages, b"", stop_after=1)
            assert own.prompt_tokens == b_count and own.cached_tokens > 0
            for n in (a, b1, b2):
                await n.shutdown(grace_s=0.2)

    trio.run(main)
