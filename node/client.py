"""A light client: its own ephemeral identity, serves nothing, talks to one node.

    async with Client.connect("/ip4/127.0.0.1/tcp/4001/p2p/12D3KooW...") as client:
        async for item in client.stream([("user", "hello")], max_tokens=32):
            if isinstance(item, str): print(item, end="")
            else: final = item                      # wire.Final: stats + route trace

The client asks the node for its model fingerprint once (``/prefixmesh/peers``), derives
the tenant's namespace key from it, and signs each request with a per-request credential
(``node.tenants``). ``model=`` asks for another model of the mesh (a name, the alias
``prefixmesh``, or a fingerprint: ``overlay/core/models.resolve`` over the node's model
catalog from the same PEERS reply): the namespace key is then derived from that model's
fingerprint and the request names it, and the node passes it to a node of that model. Every wait is bounded by the request deadline plus a small grace, so
a call never hangs: it yields the answer or raises a :class:`ClientError` subclass that
says what went wrong (:class:`ConnectFailed`, :class:`RequestFailed` with the node's
error code, :class:`ConnectionLost`, :class:`ClientTimeout`, :class:`ClientProtocolError`).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from prefixmesh.overlay.core import wire
from prefixmesh.overlay.core.identity import Identity, peer_id_to_b58
from prefixmesh.overlay.core.models import MAX_MODEL_FP_BYTES, ModelEntry, resolve
from prefixmesh.overlay.host import (
    FramedStream,
    HostError,
    OverlayHost,
    PeerTimeout,
    split_p2p_addr,
)

from .tenants import Tenant, TenantSpec, default_tenant_specs
from .turnstats import TurnStats

__all__ = [
    "ClientError",
    "ConnectFailed",
    "RequestFailed",
    "ConnectionLost",
    "ClientTimeout",
    "ClientProtocolError",
    "ModelNotFound",
    "Answer",
    "Client",
    "open_client_for_cli",
    "LOCAL_NODE_FILE",
]

#: the daemon writes its addresses here (under its cache dir) for clients without --peer
LOCAL_NODE_FILE = "node.addrs"
_GRACE_S = 3.0


class ClientError(Exception):
    """Base class of client errors."""


class ConnectFailed(ClientError):
    """The node could not be reached."""


class RequestFailed(ClientError):
    """The node answered with an ERROR frame."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class ConnectionLost(ClientError):
    """The stream ended before the answer was complete."""


class ClientTimeout(ClientError):
    """No complete answer within the deadline."""


class ClientProtocolError(ClientError):
    """The node sent something the protocol does not allow."""


class ModelNotFound(ClientError):
    """No node of the mesh (as the node sees it) serves the model asked for."""


def _models_text(models) -> str:
    return ", ".join(f"{m.name} ({m.fp_hex[:16]}, {m.nodes} node{'s' if m.nodes != 1 else ''})"
                     for m in models) or "none"


@dataclass
class Answer:
    text: str
    final: wire.Final
    ttft_s: float  # measured by the client
    total_s: float


class Client:
    def __init__(self, host: OverlayHost, peer: bytes, addr: str):
        self.host = host
        self.peer = peer
        self.addr = addr
        self.model: bytes | None = None
        self.models: tuple[ModelEntry, ...] = ()  # the mesh's models, from the PEERS reply

    @property
    def peer_b58(self) -> str:
        return peer_id_to_b58(self.peer)

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, peer_addr: str, *, identity: Identity | None = None,
                      timeout_s: float = 10.0) -> AsyncIterator[Client]:
        try:
            peer, transport = split_p2p_addr(peer_addr)
        except Exception as exc:
            raise ConnectFailed(f"bad peer address {peer_addr!r}: {exc}") from None
        host = OverlayHost(identity or Identity.generate(), [])
        async with host.run():
            try:
                await host.connect(peer, [transport], timeout_s)
            except HostError as exc:
                raise ConnectFailed(f"cannot reach {peer_addr}: {exc}") from None
            yield cls(host, peer, peer_addr)

    # --- peers -----------------------------------------------------------------------

    async def peers(self, timeout_s: float = 10.0) -> wire.PeersReply:
        try:
            stream = await self.host.open_stream(self.peer, wire.PEERS_PROTOCOL, timeout_s)
            fs = FramedStream(stream, timeout_s=timeout_s)
            await fs.send(wire.PeersQuery())
            reply = await fs.receive()
            await fs.close()
        except HostError as exc:
            raise ConnectFailed(f"peers query failed: {exc}") from None
        except wire.WireError as exc:
            raise ClientProtocolError(f"bad peers reply: {exc}") from None
        if isinstance(reply, wire.Error):  # e.g. overloaded: the node's query budget
            raise RequestFailed(reply.code, reply.message)
        if not isinstance(reply, wire.PeersReply):
            raise ClientProtocolError(f"expected PEERS_REPLY, got {type(reply).__name__}")
        self.model = reply.model
        self.models = reply.models
        return reply

    async def resolve_model(self, query: str) -> bytes:
        """The fingerprint of the model ``query`` names (a name, ``prefixmesh``, a
        fingerprint or a unique hex prefix) among the mesh's models as the node sees them
        now; a full fingerprint not listed is passed on as it is (the node decides).
        Raises :class:`ModelNotFound` naming the models there are. The catalog of an
        earlier reply is used when it names the model (a chat asks once, not every turn)."""
        entry = resolve(query, self.models) if self.models else None
        if entry is None:
            await self.peers()
            entry = resolve(query, self.models)
        if entry is not None:
            return entry.fingerprint
        q = query.strip().lower()
        if len(q) == 32 and all(c in "0123456789abcdef" for c in q):
            return bytes.fromhex(q)
        raise ModelNotFound(f"no node in the mesh serves model {query[:80]!r} now; "
                            f"models: {_models_text(self.models)}")

    async def model_fingerprint(self) -> bytes:
        if self.model is None:
            await self.peers()
        assert self.model is not None
        return self.model

    async def tenant(self, spec: TenantSpec | None = None) -> Tenant:
        spec = spec or default_tenant_specs()[0]
        return Tenant.derive(spec, await self.model_fingerprint())

    # --- requests --------------------------------------------------------------------

    async def stream(
        self,
        messages: Sequence[tuple[str, str]] = (),
        *,
        tokens: Sequence[int] = (),
        tenant: TenantSpec | Tenant | None = None,
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        deadline_s: float = 60.0,
        hop_budget: int = 2,
        model: str | bytes | None = None,
    ) -> AsyncIterator[str | wire.Final]:
        """Send one request; yield text pieces, then the FINAL frame (stats + route).
        ``model``: a fingerprint (bytes) or what :meth:`resolve_model` accepts; None:
        the node's own model."""
        fp = b""
        if model is not None:
            fp = model if isinstance(model, bytes) else await self.resolve_model(model)
            if not 0 < len(fp) <= MAX_MODEL_FP_BYTES:
                raise ModelNotFound(f"a model fingerprint has 1..{MAX_MODEL_FP_BYTES} bytes")
        if fp:  # the namespace key of that model (a tenant is bound to one model)
            spec = tenant.spec if isinstance(tenant, Tenant) else tenant
            t = Tenant.derive(spec or default_tenant_specs()[0], fp)
        else:
            t = tenant if isinstance(tenant, Tenant) else await self.tenant(tenant)
        request_id = os.urandom(16)
        deadline = time.time() + deadline_s
        req = t.sign(wire.Request(  # the credential binds id, deadline and content
            id=request_id,
            ns=t.ns_id,
            messages=tuple(wire.Message(r, c) for r, c in messages),
            tokens=tuple(tokens),
            sampling=wire.Sampling(max_tokens=max_tokens, temperature=float(temperature),
                                   top_p=float(top_p), seed=seed),
            deadline=deadline,
            hop_budget=hop_budget,
            model=fp,
        ))
        state = wire.InferStreamState()
        try:
            stream = await self.host.open_stream(self.peer, wire.INFER_PROTOCOL, min(10.0, deadline_s))
        except HostError as exc:
            raise ConnectFailed(f"cannot open a request stream: {exc}") from None
        fs = FramedStream(stream, timeout_s=10.0)
        try:
            await fs.send(req)
            state.request_sent(req)
            while True:
                remaining = deadline - time.time() + _GRACE_S
                if remaining <= 0:
                    raise ClientTimeout(f"no complete answer within {deadline_s:g} s "
                                        "(--timeout, [client].timeout_s)")
                try:
                    frame = await fs.receive(timeout_s=remaining)
                except PeerTimeout:
                    raise ClientTimeout(f"no complete answer within {deadline_s:g} s "
                                        "(--timeout, [client].timeout_s)") from None
                except HostError as exc:
                    raise ConnectionLost(f"connection lost: {exc}") from None
                except wire.WireError as exc:
                    raise ClientProtocolError(f"malformed answer: {exc}") from None
                if frame is None:
                    raise ConnectionLost("the node closed the stream before the answer was complete")
                try:
                    state.on_response(frame)
                except wire.ProtocolViolation as exc:
                    raise ClientProtocolError(str(exc)) from None
                if isinstance(frame, wire.Tokens):
                    yield frame.text
                elif isinstance(frame, wire.Final):
                    final = frame
                elif isinstance(frame, wire.End):
                    yield final
                    return
                elif isinstance(frame, wire.Error):
                    raise RequestFailed(frame.code, frame.message)
        finally:
            with trio.CancelScope(shield=True):
                if state.finished:
                    await fs.close()
                else:
                    await fs.reset()

    async def ask(self, messages: Sequence[tuple[str, str]] = (), **kwargs: Any) -> Answer:
        t0 = time.perf_counter()
        ttft = math.nan
        pieces: list[str] = []
        final: wire.Final | None = None
        async with contextlib.aclosing(self.stream(messages, **kwargs)) as items:
            async for item in items:
                if isinstance(item, str):
                    if math.isnan(ttft):
                        ttft = time.perf_counter() - t0
                    pieces.append(item)
                else:
                    final = item
        assert final is not None
        return Answer("".join(pieces), final, ttft, time.perf_counter() - t0)

    # --- CLI adapters (node/chat_cli.py) ---------------------------------------------

    def chat_send(self, max_tokens: int, tenant: TenantSpec | None = None,
                  deadline_s: float = 60.0, model: str | None = None):
        async def send(messages: list[dict[str, str]]):
            t0 = time.perf_counter()
            ttft = math.nan
            msgs = [(m["role"], m["content"]) for m in messages]
            async with contextlib.aclosing(self.stream(
                    msgs, tenant=tenant, max_tokens=max_tokens, deadline_s=deadline_s,
                    model=model)) as items:
                async for item in items:
                    if isinstance(item, str):
                        if math.isnan(ttft):
                            ttft = time.perf_counter() - t0
                        yield item
                    else:
                        yield turn_stats(item, ttft, time.perf_counter() - t0, TurnStats)

        return send

    @staticmethod
    def describe_error(exc: BaseException) -> str:
        if isinstance(exc, RequestFailed) and exc.code == "deadline":
            # the node gave up at the client's deadline: say which knob sets it
            return (f"no complete answer within the deadline (--timeout, "
                    f"[client].timeout_s): {exc.message}")
        if isinstance(exc, RequestFailed) and exc.code == "unknown_model":
            return (f"no node in the mesh serves that model now ({exc.message}); "
                    "`prefixmesh peers` lists the models there are")
        if isinstance(exc, RequestFailed):
            return f"the node refused or failed the request ({exc.code}): {exc.message}"
        if isinstance(exc, ClientError):
            return str(exc)
        return f"{type(exc).__name__}: {exc}"

    async def peers_report(self) -> dict[str, Any]:
        reply = await self.peers()
        return peers_report(reply)


def peers_report(reply: wire.PeersReply) -> dict[str, Any]:
    return {
        "self": peer_id_to_b58(reply.self_peer),
        "model": reply.model.hex(),
        "models": [{"name": m.name, "fingerprint": m.fp_hex, "nodes": m.nodes,
                    "local": m.local} for m in reply.models],
        "addrs": list(reply.addrs),
        "peers": [
            {
                "peer": peer_id_to_b58(p.peer),
                "addrs": list(p.addrs),
                "connected": p.connected,
                "up": p.up,
                "rtt_ms": p.rtt_ms,
                "queue_depth": p.queue_depth,
                "active": p.active,
                "n_hashes": p.n_hashes,
                "digest_age_s": p.digest_age_s,
                "sources": list(p.sources),
                "model": p.model.hex(),
            }
            for p in reply.peers
        ],
        "stats": dict(reply.stats),
    }


def route_lines(final: wire.Final) -> tuple[str, ...]:
    out = []
    for h in final.hops:
        line = f"{peer_id_to_b58(h.peer)[-8:]}: {h.action}"
        if h.next_peer:
            line += f" -> {peer_id_to_b58(h.next_peer)[-8:]}"
        out.append(f"{line} ({h.reason})")
    return tuple(out)


def turn_stats(final: wire.Final, ttft_s: float, total_s: float, cls):
    return cls(
        served_by=peer_id_to_b58(final.serving),
        entry=peer_id_to_b58(final.entry) if final.entry else "",
        hops=sum(1 for h in final.hops if h.action == "forward"),
        prompt_tokens=final.prompt_tokens,
        cached_tokens=final.cached_tokens,
        completion_tokens=final.completion_tokens,
        ttft_s=ttft_s,
        total_s=total_s,
        finish_reason=final.finish_reason,
        route=route_lines(final),
        batched=final.batched,
    )


def _local_node_addr(cfg: Any) -> str | None:
    """The first address in the local node's address file, or None if there is none."""
    path = Path(cfg.node.cache_dir) / LOCAL_NODE_FILE
    try:
        lines = [ln.strip() for ln in path.read_text().splitlines() if ln.strip()]
    except OSError:
        return None
    return lines[0] if lines else None


async def resolve_client_peer(cfg: Any, *, mdns_timeout_s: float = 3.0) -> str:
    """Where a CLI client connects: ``[client].peer`` (``--peer``), else the local node's
    address file, else the first node that answers on the LAN over mDNS, unless the
    configuration turns mDNS off (``[node] mdns = false``: then no prompt goes to a node
    the user did not name)."""
    addr = cfg.client.peer or _local_node_addr(cfg)
    if addr:
        return addr
    local = Path(cfg.node.cache_dir) / LOCAL_NODE_FILE
    if not cfg.node.mdns:
        raise ConnectFailed(
            f"no --peer given, no local node ({local} missing), and mDNS is off in the "
            "configuration ([node] mdns = false): start `prefixmesh node` or pass --peer "
            "/ip4/.../tcp/.../p2p/ID"
        )
    from prefixmesh.overlay.discovery import find_lan_nodes

    try:
        lan = await find_lan_nodes(mdns_timeout_s)
    except Exception as exc:  # no multicast here, zeroconf unavailable, ...
        lan = []
        reason = f" (mDNS failed: {exc})"
    else:
        reason = ""
    if not lan:
        raise ConnectFailed(
            f"no --peer given, no local node ({local} missing) and no node answered on "
            f"the LAN over mDNS{reason}: start "
            "`prefixmesh node` or pass --peer /ip4/.../tcp/.../p2p/ID"
        )
    return lan[0]


@contextlib.asynccontextmanager
async def open_client_for_cli(cfg: Any) -> AsyncIterator[Client]:
    """The client for ``prefixmesh chat/ask/peers``: connects to ``[client].peer``, the
    local node's address file, or a node found over mDNS, and binds the configured
    tenant."""
    addr = await resolve_client_peer(cfg)
    spec = cfg.tenant(cfg.client.tenant) if hasattr(cfg, "tenant") else None
    async with Client.connect(addr) as client:
        original = client.chat_send

        def chat_send(max_tokens: int, tenant: TenantSpec | None = spec,
                      deadline_s: float | None = None, model: str | None = None):
            timeout = getattr(getattr(cfg, "client", None), "timeout_s", 60.0)
            return original(max_tokens, tenant, deadline_s or timeout, model)

        client.chat_send = chat_send  # type: ignore[method-assign]
        yield client


def main(argv: list[str] | None = None) -> int:
    """``python -m prefixmesh.node.client peers ADDR`` / ``ask ADDR TEXT``: JSON on stdout
    (scripts and tests; the user-facing commands are ``prefixmesh peers/ask``)."""
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(prog="python -m prefixmesh.node.client")
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("peers")
    sp.add_argument("addr")
    sa = sub.add_parser("ask")
    sa.add_argument("addr")
    sa.add_argument("text")
    sa.add_argument("--max-tokens", type=int, default=32)
    a = p.parse_args(argv)

    async def run() -> dict[str, Any]:
        async with Client.connect(a.addr) as client:
            if a.cmd == "peers":
                return await client.peers_report()
            ans = await client.ask([("user", a.text)], max_tokens=a.max_tokens)
            return {"answer": ans.text, "serving": peer_id_to_b58(ans.final.serving),
                    "cached_tokens": ans.final.cached_tokens, "route": list(route_lines(ans.final))}

    try:
        out = trio.run(run)
    except ClientError as exc:
        print(json.dumps({"error": str(exc)}))
        return 1
    json.dump(out, sys.stdout)
    print()
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
