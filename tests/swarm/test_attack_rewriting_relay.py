"""Issue 14, finding 3, against a real node process (``--backend sim``) that holds a
private tenant's secret: an outside relay (tests/adversary/rewriting_relay.py, plain
py-libp2p + Noise, hand-edited CBOR) relays requests the tenant signed. Asserted: a
request it relays untouched (only the hop budget and visited list changed, as relays do)
is served; one whose prompt or sampling it rewrote fails with ``unauthorized`` and a
message saying the credential does not match the request content; a replay of the served
request is refused (``duplicate``); an honest client is served throughout and the node
keeps running."""

from __future__ import annotations

import os
import time

import trio
from _swarm import Swarm
from adversary.rewriting_relay import relay, rewrite_prompt, rewrite_sampling

from prefixmesh.node.client import Client
from prefixmesh.node.tenants import TenantSpec
from prefixmesh.overlay.core import wire

SECRET = "a-private-team-secret-0123456789"


def _text(frames: list[dict]) -> str:
    return "".join(f["x"] for f in frames if f.get("t") == "tok")


def test_rewriting_relay_is_caught_at_the_serving_node(tmp_path):
    cfg = tmp_path / "a.toml"
    cfg.write_text(f'[tenants.team]\nsecret = "{SECRET}"\n')
    spec = TenantSpec(name="team", secret=SECRET.encode())
    with Swarm(tmp_path) as s:
        a = s.add("A", backend="sim", extra=["--config", str(cfg)])

        async def main():
            async with Client.connect(a.addr) as c:
                tenant = await c.tenant(spec)
                honest = await c.ask([("user", "hello")], tenant=tenant, max_tokens=2)
                assert honest.final is not None

                def captured() -> bytes:  # what a relay receives from the tenant
                    return wire.encode_frame(tenant.sign(wire.Request(
                        id=os.urandom(16), ns=tenant.ns_id, tokens=tuple(range(10, 40)),
                        sampling=wire.Sampling(max_tokens=3), deadline=time.time() + 60)))

                untouched = captured()
                frames = await relay(a.addr, untouched)
                assert frames[-1]["t"] == "end", frames
                assert any(f["t"] == "fin" for f in frames), frames
                assert _text(frames), frames
                for rewrite in (rewrite_prompt, rewrite_sampling):
                    frames = await relay(a.addr, captured(), rewrite)
                    assert frames[-1]["t"] == "err", frames
                    assert frames[-1]["c"] == "unauthorized", frames
                    assert "does not match the request content" in frames[-1]["m"], frames
                    assert not _text(frames), frames
                frames = await relay(a.addr, untouched)  # the served request, again
                assert frames[-1]["t"] == "err" and frames[-1]["c"] == "duplicate", frames
                honest = await c.ask([("user", "hello again")], tenant=tenant, max_tokens=2)
                assert honest.final is not None

        trio.run(main)
        assert a.proc.poll() is None, a.log_tail()
