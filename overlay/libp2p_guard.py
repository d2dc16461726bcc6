"""Guards around py-libp2p 0.8.1 internals that hostile input could otherwise break.

Issue 14, finding 1: under a flood of fresh identities the node process exited with
``PeerStoreError: 'peer ID not found'`` raised in py-libp2p's identify handler
(``host.get_public_key()`` -> ``peerstore.pubkey(self.get_id())``). py-libp2p's
``PeerStore`` holds at most ``max_peers`` (1,000) entries and, past that, evicts entries
*without addresses first*; the node's own entry holds only its key pair and no address, so
it was the first to go. :class:`GuardedPeerStore` never evicts the node's own entry nor
the entry of a peer we hold a live connection to (their keys are read on every stream),
and evicts among the rest as the library does.

Library exceptions: py-libp2p runs every inbound stream's handler (identify, Kademlia,
relay, ping, ours) in the connection's task, and an exception raised there travelled up
through py-libp2p's nurseries to the node's top level and ended the process.
:func:`install_guards` wraps the swarm's one entry point for inbound streams
(``common_stream_handler``) so that any ``Exception`` is contained: logged once per
(protocol, exception type) at WARNING with the peer and the message (later ones at DEBUG,
counted in :data:`CONTAINED`), the stream reset, the node serving on. Cancellation passes.

Connection limits: :func:`connection_config` sets py-libp2p's limits explicitly
(:data:`MAX_CONNECTIONS`, :data:`INBOUND_RESERVE`). py-libp2p refuses an outbound dial once
``max_connections`` connections exist and caps inbound at ``max_connections -
min_connections``; it has no separate outbound cap, so our heartbeat stops dialing new
peers once :data:`MAX_OUTBOUND_CONNECTIONS` are connected
(:func:`outbound_room`): dials can never take the slots reserved for peers that dial us.

Library dials: py-libp2p itself dials too (Kademlia queries every peer a ``FIND_NODE``
answer names, with the addresses that answer gave: attacker-chosen, like digest records).
:func:`install_guards` wraps the swarm's one dial entry point (``dial_peer``) so that a dial
the node did not decide itself passes the same :class:`~.core.dialing.DialGate` as the
heartbeat's (global rate, per-address and per-/24 budgets, in flight), and uses only the
addresses the gate admitted; over budget it fails at once (:data:`LIBRARY_DIALS_REFUSED`).
The node's own dials (``OverlayHost.connect``, already admitted by the heartbeat or made
to a configured bootstrap peer) run inside :func:`own_dial` and are not charged twice.

Inbound slots: py-libp2p caps inbound connections with a ``CapacityLimiter`` whose token
each inbound handler holds until it returns, and the handler does not return when its
connection closes: after the upgrade it waits for the *swarm* to finish
(``network/swarm.py`` ``_do_handle_inbound_connection``: "Intentional barrier: keep
handler alive"). So the cap counted every inbound connection since start, and after
``max_connections`` of them (a day of `prefixmesh ask` calls, or one Sybil flood plus the
honest clients around it) the node refused every new inbound connection for good
(measured: 200 Sybil identities, then honest clients, each on a new connection: all
refused from about the 500th connection, also after the attacker left).
:func:`install_guards` ends a handler's wait when its own connection closes
(:func:`release_inbound_on_close`), so the token, the handler task and what it holds go
back with the connection; the cap now counts live inbound connections.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable

import trio
from libp2p.abc import INotifee
from libp2p.network.config import ConnectionConfig, RetryConfig
from libp2p.peer.id import ID
from libp2p.peer.peerstore import PeerStore

from .core.admission import InboundConn, inbound_victim
from .core.dialing import DialGate
from .core.identity import peer_id_to_b58

__all__ = [
    "GuardedPeerStore",
    "InboundGate",
    "LibraryDialRefused",
    "own_dial",
    "connection_config",
    "install_guards",
    "outbound_room",
    "MAX_CONNECTIONS",
    "INBOUND_RESERVE",
    "MAX_OUTBOUND_CONNECTIONS",
    "MAX_PEERSTORE_PEERS",
]

log = logging.getLogger(__name__)

#: (protocol, exception type name) -> how many exceptions the stream guard contained
CONTAINED: Counter[tuple[str, str]] = Counter()
#: py-libp2p's own dials (Kademlia, ...) refused by the dial gate, this process
LIBRARY_DIALS_REFUSED = Counter()
#: set while the node dials on its own decision (module docstring)
_OWN_DIAL: contextvars.ContextVar[bool] = contextvars.ContextVar("own_dial", default=False)

#: all connections (py-libp2p's default is 300, set here so it is ours to reason about): a
#: connection costs a few file descriptors and ~100 KiB of buffers; 512 stays far below a
#: default 1,024-fd limit with the KV cache's files open
MAX_CONNECTIONS = 512
#: connections kept for peers that dial us: outbound dials never take these
INBOUND_RESERVE = 256
#: connections we dial ourselves, at most (the rest of MAX_CONNECTIONS)
MAX_OUTBOUND_CONNECTIONS = MAX_CONNECTIONS - INBOUND_RESERVE
#: peerstore entries (py-libp2p's default 1,000): one per peer we dialled, that dialled us
#: or that Kademlia returned; our own and connected peers' entries are never evicted
MAX_PEERSTORE_PEERS = 2048


def connection_config() -> ConnectionConfig:
    """py-libp2p's connection settings for a node (module docstring)."""
    return ConnectionConfig(
        max_connections=MAX_CONNECTIONS,
        max_connections_per_peer=1,  # also removes a ~250 ms happy-eyeballs wait
        # py-libp2p's inbound cap is max_connections - min_connections: inbound may use
        # everything outbound does not. These watermarks do not idle its auto-connector (it
        # dials peerstore peers up to the midpoint of low and high, 150), so a peer the
        # node left may be dialled again within a second: nothing may read "connected" as
        # "the same connection" (the relay keeper compares connection objects)
        min_connections=0,
        low_watermark=0,
    )


def install_guards(libp2p_host, peerstore: GuardedPeerStore, dial_gate: DialGate) -> None:
    """Wire the guards into a host made by ``new_host(..., peerstore_opt=peerstore)``;
    ``dial_gate`` is the node's one dial gate (module docstring, "Library dials").

    Also: py-libp2p retries every address of a dial 3 more times (``RetryConfig``, not a
    ``new_host`` argument), which made each of our dials 4 TCP attempts per address; our
    heartbeat has its own backoff, so the swarm makes one attempt per address."""
    network = libp2p_host.get_network()
    peerstore.connected = lambda: list(network.connections)
    network.retry_config = RetryConfig(max_retries=0)
    network.common_stream_handler = guard_stream_handler(network.common_stream_handler)
    network.dial_peer = gate_library_dials(network, peerstore, dial_gate)
    release_inbound_on_close(network)


#: the cancel scope of the inbound handler now upgrading a connection (its own task)
_INBOUND_SCOPE: contextvars.ContextVar[trio.CancelScope | None] = contextvars.ContextVar(
    "inbound_scope", default=None)


def release_inbound_on_close(network) -> None:
    """End each inbound handler's keep-alive wait when its connection closes (module
    docstring, "Inbound slots"): the handler runs in a cancel scope, the upgrade notes
    which connection that scope belongs to, and the disconnect notification cancels it;
    py-libp2p's ``finally`` then gives the inbound token back."""
    scopes: dict[int, trio.CancelScope] = {}  # id(muxed conn) -> its handler's scope
    handle = network._do_handle_inbound_connection
    upgrade = network.upgrade_inbound_raw_conn

    async def handle_in_scope(read_write_closer, maddr, failure_event) -> None:
        with trio.CancelScope() as scope:
            token = _INBOUND_SCOPE.set(scope)
            try:
                await handle(read_write_closer, maddr, failure_event)
            finally:
                _INBOUND_SCOPE.reset(token)

    async def upgrade_noted(raw_conn, maddr):
        muxed = await upgrade(raw_conn, maddr)
        scope = _INBOUND_SCOPE.get()
        if scope is not None:
            scopes[id(muxed)] = scope
        return muxed

    class _Closed(QuietNotifee):
        async def disconnected(self, network, conn) -> None:
            scope = scopes.pop(id(getattr(conn, "muxed_conn", None)), None)
            if scope is not None:
                scope.cancel()

    network._do_handle_inbound_connection = handle_in_scope
    network.upgrade_inbound_raw_conn = upgrade_noted
    network.register_notifee(_Closed())


class QuietNotifee(INotifee):
    """A py-libp2p notifee that ignores every event; subclasses override the ones they
    need (the interface has six abstract methods)."""

    async def connected(self, network, conn) -> None:
        pass

    async def disconnected(self, network, conn) -> None:
        pass

    async def opened_stream(self, network, stream) -> None:
        pass

    async def closed_stream(self, network, stream) -> None:
        pass

    async def listen(self, network, multiaddr) -> None:
        pass

    async def listen_close(self, network, multiaddr) -> None:
        pass


def remote_multiaddr(conn) -> str:
    """``/ip4|ip6/<ip>/tcp/<port>`` of a connection's remote end, or "" if unknown."""
    try:
        got = conn.muxed_conn.get_remote_address()
    except Exception:  # a connection closing under us
        return ""
    if not got:
        return ""
    host, port = got[0], got[1]
    return f"/{'ip6' if ':' in host else 'ip4'}/{host}/tcp/{port}"


class InboundGate(QuietNotifee):
    """Applies :attr:`OverlayHost.inbound_cap` to connections peers dial to us, and keeps
    room for newcomers (:func:`~.core.admission.inbound_victim`)."""

    def __init__(self, host) -> None:  # an OverlayHost (host.py imports us)
        self.host = host

    async def connected(self, network, conn) -> None:
        if str(getattr(conn, "direction", "")) != "inbound":
            return
        peer = conn.muxed_conn.peer_id.to_bytes()
        host = self.host
        await self._make_room(network, peer)
        if host.inbound_cap is None:
            return

        def is_stale(p: bytes) -> bool:
            return not network.get_connections(ID(p)) or host.peer_is_down(p)

        admitted, evicted = host.inbound_cap.admit(peer, remote_multiaddr(conn), is_stale)
        for p in evicted:  # their slots went to the newcomer: close what is left of them
            with contextlib.suppress(Exception):
                await host.disconnect(p)
        if admitted:
            return
        host.inbound_refused += 1
        log.info("inbound connection from %s refused: its subnet holds its share",
                 peer_id_to_b58(peer))
        with contextlib.suppress(Exception):
            await conn.close()

    async def _make_room(self, network, newcomer: bytes) -> None:
        conns = []
        for c in network.get_connections():
            if str(getattr(c, "direction", "")) != "inbound":
                continue
            with contextlib.suppress(Exception):
                p = c.muxed_conn.peer_id.to_bytes()
                conns.append(InboundConn(p, self.host.peer_is_known(p), len(c.get_streams()),
                                         getattr(c, "_created_at", 0.0)))
        victim = inbound_victim(conns, newcomer)
        if victim is not None:
            self.host.inbound_evicted += 1
            log.debug("inbound connections near py-libp2p's limit: closed %s's for a newcomer",
                      peer_id_to_b58(victim)[-8:])
            with contextlib.suppress(Exception):
                await self.host.disconnect(victim)

    async def disconnected(self, network, conn) -> None:
        peer_id = conn.muxed_conn.peer_id
        if self.host.inbound_cap is not None and not network.get_connections(peer_id):
            self.host.inbound_cap.release(peer_id.to_bytes())  # its last connection went


class LibraryDialRefused(Exception):
    """A dial py-libp2p wanted to make is over the node's dial budget."""


@contextlib.contextmanager
def own_dial():
    """Mark the dials made inside as the node's own (not charged to the library's budget)."""
    token = _OWN_DIAL.set(True)
    try:
        yield
    finally:
        _OWN_DIAL.reset(token)


def gate_library_dials(network, peerstore: PeerStore, gate: DialGate,
                       clock: Callable[[], float] = time.monotonic):
    """``network.dial_peer`` with the dial gate in front of dials the node did not decide."""
    dial_peer = network.dial_peer

    async def gated(peer_id: ID):
        if _OWN_DIAL.get() or any(not c.is_closed for c in network.get_connections(peer_id)):
            return await dial_peer(peer_id)
        try:
            known = list(peerstore.addrs(peer_id))
        except Exception:  # no entry: the library's own error says it best
            return await dial_peer(peer_id)
        ticket = gate.admit([str(a) for a in known], clock())
        if ticket is None:
            LIBRARY_DIALS_REFUSED["refused"] += 1
            raise LibraryDialRefused(
                f"dial to {peer_id.to_base58()[-8:]} refused: over this node's dial budget")
        # only the admitted addresses are dialled (the budget was charged for those)
        admitted = [a for a in known if str(a) in ticket.addrs]
        with contextlib.suppress(Exception):
            peerstore.clear_addrs(peer_id)
            peerstore.add_addrs(peer_id, admitted, 120)
        ok = False
        try:
            conns = await dial_peer(peer_id)
            ok = True
            return conns
        finally:
            gate.done(ticket, ok)

    return gated


def guard_stream_handler(handler):
    """``handler(stream)`` with library exceptions contained (module docstring)."""

    async def guarded(net_stream) -> None:
        try:
            await handler(net_stream)
        except trio.Cancelled:
            raise
        except Exception as exc:
            contain(exc, _protocol_of(net_stream), _peer_of(net_stream))
            with contextlib.suppress(Exception), trio.move_on_after(1):
                await net_stream.reset()

    return guarded


def contain(exc: BaseException, where: str, peer: str = "?") -> None:
    """Log a contained library exception: once per (where, type) loudly, then quietly."""
    key = (where, type(exc).__name__)
    CONTAINED[key] += 1
    level = logging.WARNING if CONTAINED[key] == 1 else logging.DEBUG
    log.log(level, "contained %s in py-libp2p %s (peer %s): %s; the node keeps serving "
            "(further ones of this kind at DEBUG)", key[1], where, peer, str(exc)[:200],
            exc_info=CONTAINED[key] == 1 and log.isEnabledFor(logging.DEBUG))


def _protocol_of(net_stream) -> str:
    with contextlib.suppress(Exception):
        return str(net_stream.get_protocol() or "stream handler")
    return "stream handler"


def _peer_of(net_stream) -> str:
    with contextlib.suppress(Exception):
        return net_stream.muxed_conn.peer_id.to_base58()[-8:]
    return "?"


def outbound_room(n_outbound: int) -> bool:
    """True while another outbound connection leaves the inbound reserve intact."""
    return n_outbound < MAX_OUTBOUND_CONNECTIONS


class GuardedPeerStore(PeerStore):
    """A py-libp2p ``PeerStore`` whose eviction spares our own entry and connected peers."""

    def __init__(self, self_id: ID, max_peers: int = MAX_PEERSTORE_PEERS) -> None:
        super().__init__(max_peers=max_peers)
        self.self_id = self_id
        # set by the host once the swarm exists: ids with a live connection
        self.connected: Callable[[], Iterable[ID]] = tuple
        self.evictions_refused = 0

    def _protected(self) -> dict:
        keep = {self.self_id}
        try:
            keep.update(self.connected())
        except Exception:  # a swarm closing under us: our own entry is what matters most
            pass
        return {pid: self.peer_data_map.pop(pid) for pid in keep if pid in self.peer_data_map}

    def _restore(self, kept: dict) -> None:
        self.peer_data_map.update(kept)

    def _enforce_peer_limit(self) -> None:
        kept = self._protected()
        saved = self.max_peers
        self.max_peers = max(0, saved - len(kept))
        try:
            super()._enforce_peer_limit()
        finally:
            self.max_peers = saved
            self._restore(kept)

    def _cleanup_expired_records(self) -> None:
        kept = self._protected()
        saved = self.max_peers
        self.max_peers = max(0, saved - len(kept))
        try:
            super()._cleanup_expired_records()
        finally:
            self.max_peers = saved
            self._restore(kept)

    def clear_peerdata(self, peer_id: ID) -> None:
        if peer_id == self.self_id:
            self.evictions_refused += 1
            log.debug("refused to clear our own peerstore entry")
            return
        super().clear_peerdata(peer_id)
