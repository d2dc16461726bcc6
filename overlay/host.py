"""The node's libp2p host (py-libp2p 0.8.1 on trio) and framed stream helpers.

Security
    Noise only. py-libp2p's default also offers ``/plaintext/2.0.0`` (and secio, TLS);
    with plaintext a dialer that merely *presents* someone's public key is accepted as
    that peer, so every signature check keyed on the remote peer id would be void. We
    pass ``sec_opt`` with the Noise transport alone; a plaintext-only dialer fails
    multistream negotiation.

Identity
    The libp2p key pair is derived from the node's Ed25519 seed
    (``Identity.seed_bytes()``), so the libp2p peer id and the peer id that signs our
    digest records are the same bytes.

Timeouts
    py-libp2p has no timeout on TCP dial or on the security upgrade, and a SIGSTOPped peer
    keeps its TCP connection open (reads block forever, ``new_stream`` fails only after
    10 s). Every connect, new_stream, read and write here therefore runs under
    ``trio.fail_after``; expiry surfaces as :class:`PeerTimeout`.

Addresses
    A listen address with port 0 is resolved to the bound port, and ``0.0.0.0`` is never
    advertised: it is replaced with the machine's concrete IPv4 interface addresses
    (peers, mDNS in particular, cannot dial 0.0.0.0).

Listen ports
    py-libp2p listens with ``SO_REUSEPORT``: :meth:`OverlayHost.run` first checks each
    fixed listen port without it (``overlay/ports.py``, :class:`ListenAddrInUse`).

Connections
    ``ConnectionConfig(max_connections_per_peer=1)``: besides bounding resources, it
    removes a fixed ~250 ms happy-eyeballs wait from every connect. With an
    ``inbound_cap`` (:class:`~.trust.InboundSubnetCap`), a connection a peer dialled to us
    from a subnet that already holds its share of our inbound connections is closed as soon
    as libp2p registers it (a swarm notifee; counted in :attr:`OverlayHost.inbound_refused`),
    unless a counted peer of that subnet is stale (no live connection, or
    :attr:`OverlayHost.peer_is_down`): that one is disconnected and its slot reused.

Circuits (issue 16)
    py-libp2p's swarm never dials ``/p2p-circuit`` addresses: :meth:`OverlayHost.connect`
    dials them itself (CONNECT at the relay over the library's messages, then the usual
    Noise + Yamux upgrade over that stream), under the same timeout, after the direct
    addresses failed. Ours rather than ``CircuitV2Transport.dial``: a dial cut short by
    our timeout must reset its stream at the relay, or the relay keeps splicing a circuit
    nobody uses (measured in the lab: every relay's circuits filled up with them and it
    refused new ones). Every node runs the stop side (:class:`~.relay.FixedHop` without
    hop) to accept relayed connections. A private node with reservations advertises its
    circuit addresses instead of its listen addresses (:meth:`OverlayHost.set_circuit_addrs`);
    :meth:`OverlayHost.link_kind` tells relayed from direct links. Private addresses of
    peers off our own networks never reach the peerstore
    (:func:`~.core.relaying.keep_peer_addr`): identify reports a home's LAN address, and a
    relay dialling it wasted 8 s (docs/bench/nat.md).

py-libp2p is imported when the host is first used, not with this module
    Its import takes ~0.5 s of Python (its QUIC transport alone ~0.3 s, never used), longer
    than loading the model and indexing a 1.6 GB KV cache. The node answers HTTP on its
    engine first and joins the overlay after (``node/daemon.py``, "Start-up");
    :meth:`OverlayHost.run` imports py-libp2p in a worker thread, so the requests served
    meanwhile are not stalled. Methods that only report (addresses, connections) report
    nothing before the library is loaded; the others load it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import socket
import struct
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence

import trio

from .core import relaying, wire
from .core.dialing import DialGate
from .core.digest import DigestError
from .core.identity import Identity, peer_id_to_b58
from .core.streamslots import frame_budget_s
from .ports import HostError, ListenAddrInUse, check_listen_addrs_free, note_bound

__all__ = [
    "HostError",
    "FrameTimeout",
    "ListenAddrInUse",
    "check_listen_addrs_free",
    "PeerUnreachable",
    "PeerTimeout",
    "StreamClosedError",
    "OverlayHost",
    "FramedStream",
    "split_p2p_addr",
    "concrete_ipv4_addrs",
    "remote_peer",
    "ResponderGate",
]

log = logging.getLogger(__name__)

#: default seconds for one dial (TCP + Noise + Yamux)
DIAL_TIMEOUT_S = 5.0
#: a dial through a relay may take this many times the dial timeout (module docstring)
CIRCUIT_DIAL_FACTOR = 3
#: default seconds for opening a stream on an existing connection (multistream select)
STREAM_TIMEOUT_S = 5.0
#: largest raw (non-CBOR-frame) message on our byte-message protocols (digest exchange)
MAX_RAW_MESSAGE_BYTES = 1024 * 1024
_READ_CHUNK = 64 * 1024


class PeerUnreachable(HostError):
    """Dialing or opening a stream failed (no address worked, refused, reset, ...)."""


class PeerTimeout(HostError):
    """A network operation did not complete within its deadline (e.g. a frozen peer)."""


class StreamClosedError(HostError):
    """The remote end closed or reset the stream."""


class FrameTimeout(PeerTimeout):
    """A frame began but did not arrive complete within its whole-frame budget
    (:func:`~.core.streamslots.frame_budget_s`): a slow or trickling peer."""


def _peer_id(peer: bytes):
    """py-libp2p's ``ID`` of peer id bytes (imported on first use: module docstring)."""
    from libp2p.peer.id import ID

    return ID(peer)


def remote_peer(stream) -> bytes:
    """Peer id bytes of the other end of a libp2p stream."""
    return stream.muxed_conn.peer_id.to_bytes()


def split_p2p_addr(addr: str) -> tuple[bytes, str]:
    """``/ip4/1.2.3.4/tcp/5/p2p/<id>`` -> (peer id bytes, ``/ip4/1.2.3.4/tcp/5``)."""
    _import_libp2p()  # the first import of py-libp2p in a client: keep our logging
    import multiaddr
    from libp2p.peer.id import ID

    ma = multiaddr.Multiaddr(addr)
    try:
        b58 = ma.value_for_protocol("p2p")
    except Exception:
        b58 = None
    if not b58:
        raise ValueError(f"{addr}: multiaddr has no /p2p/<peer id> part")
    transport = ma.decapsulate(multiaddr.Multiaddr(f"/p2p/{b58}"))
    return ID.from_base58(b58).to_bytes(), str(transport)


def concrete_ipv4_addrs() -> list[str]:
    """IPv4 addresses of the machine's interfaces that are up (loopback included)."""
    out: list[str] = []
    for _, name in socket.if_nameindex():
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(
                s.fileno(),
                0x8915,
                struct.pack("256s", name.encode()[:15]),  # SIOCGIFADDR
            )
            out.append(socket.inet_ntoa(packed[20:24]))
    return out or ["127.0.0.1"]


def _expand_unspecified(addrs: list) -> list:
    """Multiaddrs with ``/ip4/0.0.0.0`` replaced by each concrete interface address."""
    import multiaddr

    result: list = []
    for a in addrs:
        text = str(a)
        if text.startswith("/ip4/0.0.0.0/"):
            rest = text[len("/ip4/0.0.0.0") :]
            result.extend(multiaddr.Multiaddr(f"/ip4/{ip}{rest}") for ip in concrete_ipv4_addrs())
        else:
            result.append(a)
    # dedupe, keep order
    seen: set[str] = set()
    return [a for a in result if not (str(a) in seen or seen.add(str(a)))]


StreamHandler = Callable[[object], Awaitable[None]]


def _lone_exception(group: BaseExceptionGroup) -> BaseException | None:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        if len(exc.exceptions) != 1:
            return None
        exc = exc.exceptions[0]
    return exc


@contextlib.contextmanager
def unwrapping_lone_exception() -> Iterator[None]:
    """An exception a nursery (or libp2p's nested nurseries) wrapped in groups of one comes
    out as itself; a group of several stays a group."""
    try:
        yield
    except BaseExceptionGroup as group:
        lone = _lone_exception(group)
        if lone is None:
            raise
        raise lone from None


def _import_libp2p() -> None:
    """What building a host imports (module docstring): py-libp2p and our parts of it.
    py-libp2p's import resets its ``libp2p`` logger (no handler, no propagation): a logger
    the process had set up before (a level set, as the node's logging does) is kept."""
    lib = logging.getLogger("libp2p")
    before = (list(lib.handlers), lib.propagate, lib.level)
    first = "libp2p" not in sys.modules
    import libp2p  # noqa: F401

    from . import libp2p_guard, relay  # noqa: F401

    if first and before[2] != logging.NOTSET:
        lib.handlers[:], lib.propagate = before[0], before[1]
        lib.setLevel(before[2])


def _filter_peer_addrs(peerstore, keep: Callable[[str], bool]) -> None:
    """Make ``peerstore.add_addrs`` (identify, Kademlia and ours all go through it) drop
    the addresses ``keep`` refuses."""
    add_addrs = peerstore.add_addrs

    def filtered(peer_id, addrs, ttl: int = 0) -> None:
        kept = [a for a in addrs if keep(str(a))]
        if kept:
            add_addrs(peer_id, kept, ttl)

    peerstore.add_addrs = filtered


class OverlayHost:
    """A py-libp2p host with our security, identity and timeout policy."""

    def __init__(
        self,
        identity: Identity,
        listen_addrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
        *,
        dial_timeout_s: float = DIAL_TIMEOUT_S,
        stream_timeout_s: float = STREAM_TIMEOUT_S,
        inbound_cap=None,
        observe_addrs: bool = False,
    ):
        self.identity = identity
        self.peer_id: bytes = identity.peer_id
        self.dial_timeout_s = dial_timeout_s
        self.stream_timeout_s = stream_timeout_s
        self._listen = list(listen_addrs)
        self._observe_addrs = observe_addrs
        self._libp2p = None  # built on first use (module docstring)
        # the node's one dial gate: the heartbeat's dials and py-libp2p's own (Kademlia)
        # pass it (overlay/core/dialing.py, libp2p_guard)
        self.dial_gate = DialGate()
        self._own_ips = concrete_ipv4_addrs()
        self._circuit_addrs: list[str] = []
        self._nursery: trio.Nursery | None = None
        # pre-negotiated idle streams: (peer, protocol) -> [(stream, opened_at)]
        self._pool: dict[tuple[bytes, str], list[tuple[object, float]]] = {}
        self._refilling: set[tuple[bytes, str]] = set()
        self.pool_hits = 0
        self.pool_misses = 0
        self.inbound_cap = inbound_cap
        self.inbound_refused = 0
        # set by the daemon to the heartbeat's verdict: a down peer's inbound slot may be
        # reclaimed (the transport may not notice a dead connection for a long time)
        self.peer_is_down: Callable[[bytes], bool] = lambda peer: False
        # peers with history (the daemon: up on our heartbeat long enough), whose inbound
        # connections are never closed to make room for a stranger
        self.peer_is_known: Callable[[bytes], bool] = lambda peer: False
        self.inbound_evicted = 0

    @property
    def libp2p(self):
        """The py-libp2p host, built (and the library imported) on first use."""
        if self._libp2p is None:
            self._libp2p = self._build()
        return self._libp2p

    def _build(self):
        _import_libp2p()  # at once when run() did not do it first (it keeps our logging)
        import multiaddr
        from libp2p import new_host
        from libp2p.crypto.ed25519 import create_new_key_pair
        from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
        from libp2p.custom_types import TProtocol
        from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
        from libp2p.security.noise.transport import Transport as NoiseTransport

        from .libp2p_guard import GuardedPeerStore, InboundGate, connection_config, install_guards
        from .relay import FixedHop, relay_limits

        key_pair = create_new_key_pair(self.identity.seed_bytes())
        if key_pair.public_key.to_bytes() != self.identity.public_bytes:  # pragma: no cover
            raise HostError("libp2p derived a different public key from our seed")
        noise = NoiseTransport(key_pair, noise_privkey=create_x25519_key_pair().private_key)
        host = new_host(
            key_pair=key_pair,
            sec_opt={TProtocol(NOISE_PROTOCOL_ID): noise},
            # no auto-dialing of every peerstore entry: our heartbeat decides whom to keep;
            # explicit limits and a peerstore that never evicts our own key (libp2p_guard)
            connection_config=connection_config(),
            peerstore_opt=(peerstore := GuardedPeerStore(_peer_id(self.peer_id))),
            listen_addrs=[multiaddr.Multiaddr(a) for a in self._listen],
            addrs_factory=_expand_unspecified,
            # identify's observed addresses: DCUtR needs our WAN address (nat.md, bug 4)
            disable_identify_address_discovery=not self._observe_addrs,
        )
        if host.get_id().to_bytes() != self.peer_id:  # pragma: no cover
            raise HostError("libp2p peer id differs from our identity's peer id")
        install_guards(host, peerstore, self.dial_gate)
        _filter_peer_addrs(peerstore, lambda a: relaying.keep_peer_addr(a, self._own_ips))
        # circuits: our stop side (module docstring, "Circuits")
        self.circuit_stop = FixedHop(host, limits=relay_limits(), allow_hop=False)
        # the subnet cap (when set) and room for newcomers (always)
        host.get_network().register_notifee(InboundGate(self))
        return host

    # --- lifecycle -------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def run(self) -> AsyncIterator[OverlayHost]:
        """Run the host. An exception raised by the body comes out as itself: libp2p's
        internal nurseries wrap it in (nested) ExceptionGroups, which we unwrap when they
        hold that one exception only."""
        check_listen_addrs_free(self._listen)
        if self._libp2p is None:
            # off the event loop: the node serves HTTP meanwhile (module docstring)
            await trio.to_thread.run_sync(_import_libp2p, abandon_on_cancel=True)
        import multiaddr
        from libp2p.tools.anyio_service import background_trio_service

        listen = [multiaddr.Multiaddr(a) for a in self._listen]
        with unwrapping_lone_exception():
            async with self.libp2p.run(listen_addrs=listen), \
                    background_trio_service(self.circuit_stop), trio.open_nursery() as nursery:
                note_bound(self._listen)
                self._nursery = nursery
                try:
                    yield self
                finally:
                    self._nursery = None
                    # py-libp2p's own exit leaves its connections' sockets open: the peer
                    # would hold a dead connection (and an inbound slot) until it notices
                    with trio.CancelScope(shield=True), trio.move_on_after(1):
                        await self._close_connections()
                    nursery.cancel_scope.cancel()

    async def _close_connections(self) -> None:
        network = self.libp2p.get_network()

        async def close(pid) -> None:
            with contextlib.suppress(Exception):
                await network.close_peer(pid)

        async with trio.open_nursery() as nursery:  # all at once: a stop stays quick
            for pid in list(network.connections):
                nursery.start_soon(close, pid)

    # --- addresses -------------------------------------------------------------------

    def listen_addrs(self) -> list[str]:
        """The transport addresses we advertise (no trailing ``/p2p/SELF``): our circuit
        addresses while :meth:`set_circuit_addrs` holds some (a private node reserved at
        relays), else :meth:`transport_addrs`."""
        return list(self._circuit_addrs) or self.transport_addrs()

    def transport_addrs(self) -> list[str]:
        """Concrete transport addresses (no ``/p2p`` part; never 0.0.0.0, never port 0)."""
        if self._libp2p is None:
            return []  # not listening yet
        return [str(a) for a in _expand_unspecified(self._libp2p.get_transport_addrs())]

    def set_circuit_addrs(self, addrs: Sequence[str]) -> None:
        """Advertise these ``/.../p2p/R/p2p-circuit`` addresses (none: our listen ones)."""
        self._circuit_addrs = [relaying.transport_part(a) for a in addrs]

    def link_kind(self, peer: bytes) -> str | None:
        """``relayed`` or ``direct`` for our live connection to ``peer`` (None: none)."""
        if self._libp2p is None:
            return None
        try:
            conns = self._libp2p.get_network().get_connections(_peer_id(peer))
        except Exception:
            return None
        kinds = set()
        for conn in conns:
            try:
                addrs = [str(a) for a in conn.get_transport_addresses()]
            except Exception:
                addrs = []
            kinds.add("relayed" if any(relaying.is_circuit(a) for a in addrs) else "direct")
        if not kinds:
            return None
        return "direct" if "direct" in kinds else "relayed"

    def full_addrs(self) -> list[str]:
        """Dialable multiaddrs with our ``/p2p/<id>`` suffix."""
        return [f"{a}/p2p/{self.identity.peer_id_b58}" for a in self.listen_addrs()]

    # --- peers -----------------------------------------------------------------------

    def add_addrs(self, peer: bytes, addrs: Sequence[str]) -> None:
        import multiaddr

        good = []
        for a in addrs:
            try:
                good.append(multiaddr.Multiaddr(a))
            except Exception:
                log.debug("ignoring malformed multiaddr %r for %s", a, peer_id_to_b58(peer))
        if good:
            self.libp2p.get_peerstore().add_addrs(_peer_id(peer), good, 3600)

    def is_connected(self, peer: bytes) -> bool:
        if self._libp2p is None:
            return False
        return _peer_id(peer) in self._libp2p.get_network().connections

    def links(self, peer: bytes) -> tuple[object, ...]:
        """Our live connections to ``peer``, as opaque objects to compare by identity: a
        connection that closed and was dialled again (by us or by the library) is a new
        object, although :meth:`is_connected` never saw it gone."""
        if self._libp2p is None:
            return ()
        try:
            return tuple(self._libp2p.get_network().get_connections(_peer_id(peer)))
        except Exception:  # an id the swarm cannot even parse: no live connection
            return ()

    def remote_addrs(self, peer: bytes) -> list[str]:
        """``/ip4|ip6/<ip>/tcp/<port>`` of our live connections to ``peer``, as the
        transport saw them: where the peer really is, not what its records claim."""
        out: list[str] = []
        if self._libp2p is None:
            return out
        try:
            conns = self._libp2p.get_network().get_connections(_peer_id(peer))
        except Exception:  # an id the swarm cannot even parse: no live connection
            return out
        from .libp2p_guard import remote_multiaddr

        for conn in conns:
            addr = remote_multiaddr(conn)
            if addr:
                out.append(addr)
        return out

    def connected_peers(self) -> list[bytes]:
        if self._libp2p is None:
            return []
        return [p.to_bytes() for p in self._libp2p.get_connected_peers()]

    async def connect(
        self, peer: bytes, addrs: Sequence[str] = (), timeout_s: float | None = None
    ) -> None:
        """Connect (or reuse a connection) within ``timeout_s``; raises :class:`HostError`.
        Direct addresses first, then circuit addresses (module docstring, "Circuits")."""
        import multiaddr
        from libp2p.peer.peerinfo import PeerInfo

        from .libp2p_guard import own_dial

        if peer == self.peer_id:
            raise PeerUnreachable("refusing to dial ourselves")
        addrs = [a for a in addrs if relaying.keep_peer_addr(a, self._own_ips)]
        circuits = [a for a in addrs if relaying.is_circuit(a)
                    and relaying.relay_of_circuit(a) != self.identity.peer_id_b58]
        direct = [a for a in addrs if not relaying.is_circuit(a)]
        self.add_addrs(peer, direct)
        pid = _peer_id(peer)
        network = self.libp2p.get_network()
        with contextlib.suppress(Exception):
            network.unblock_peer(pid)  # our own backoff decides when to retry
        timeout_s = timeout_s or self.dial_timeout_s
        try:
            with own_dial():  # admitted by our caller (heartbeat) or configured
                if self.is_connected(peer) or not circuits:
                    with trio.fail_after(timeout_s):
                        await self.libp2p.connect(
                            PeerInfo(pid, [multiaddr.Multiaddr(a) for a in direct]))
                    return
                if direct:
                    with contextlib.suppress(Exception), trio.fail_after(timeout_s):
                        await self.libp2p.connect(
                            PeerInfo(pid, [multiaddr.Multiaddr(a) for a in direct]))
                        return
                # a relayed dial is two TCP hops and the relay's CONNECT/STOP exchange
                # before the handshake: it gets CIRCUIT_DIAL_FACTOR times the time
                with trio.fail_after(timeout_s * CIRCUIT_DIAL_FACTOR):
                    await self._dial_circuits(peer, circuits)
        except trio.TooSlowError:
            raise PeerTimeout(f"dial {peer_id_to_b58(peer)[:16]} timed out") from None
        except (HostError, trio.Cancelled):
            raise
        except Exception as exc:
            raise PeerUnreachable(f"dial {peer_id_to_b58(peer)[:16]} failed: {exc}") from None

    async def _dial_circuits(self, peer: bytes, circuits: Sequence[str]) -> None:
        """Dial ``peer`` through the relays of ``circuits``, one after the other."""
        b58 = peer_id_to_b58(peer)
        errors = []
        for a in circuits:
            try:
                await self._dial_circuit(peer, a)
                return
            except trio.Cancelled:
                raise
            except Exception as exc:
                errors.append(f"{a}: {exc}")
        raise PeerUnreachable(f"dial {b58[:16]} through relays failed: {'; '.join(errors)}")

    async def _dial_circuit(self, peer: bytes, circuit: str) -> None:
        """CONNECT to ``peer`` at the relay of ``circuit`` and upgrade the stream into a
        connection; the stream is reset if anything fails or is cancelled."""
        import multiaddr
        from libp2p.connection_types import ConnectionType
        from libp2p.network.connection.raw_connection import RawConnection
        from libp2p.peer.id import ID
        from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
        from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
        from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
        from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

        from .relay import HOP_PROTOCOL

        relay_b58 = relaying.relay_of_circuit(circuit)
        if relay_b58 is None:
            raise PeerUnreachable(f"{circuit}: not a circuit address")
        relay = ID.from_base58(relay_b58).to_bytes()
        await self.connect(relay, [circuit[: circuit.index(f"/p2p/{relay_b58}")]])
        stream = await self.open_stream(relay, HOP_PROTOCOL)
        ok = False
        try:
            await write_delimited_msg(stream, HopMessage(type=HopMessage.CONNECT,
                                                         peer=CircuitPeerId(id=peer)))
            resp = await read_delimited_msg(stream, HopMessage)
            status = StatusCode(resp.status) if resp.HasField("status") else StatusCode.OK
            if status != StatusCode.OK:
                raise PeerUnreachable(f"relay {relay_b58[-8:]} refused: {status.name}")
            raw = RawConnection(stream=stream, initiator=True,
                                connection_type=ConnectionType.RELAYED,
                                addresses=[multiaddr.Multiaddr(
                                    f"{circuit}/p2p/{peer_id_to_b58(peer)}")])
            await self.libp2p.upgrade_outbound_connection(raw, ID(peer))
            ok = True
        finally:
            if not ok:  # also when our dial timeout cancelled us: shielded
                with trio.CancelScope(shield=True):
                    await _reset_quietly(stream)

    async def disconnect(self, peer: bytes) -> None:
        with contextlib.suppress(Exception), trio.move_on_after(2):
            await self.libp2p.disconnect(_peer_id(peer))

    async def open_stream(self, peer: bytes, protocol: str, timeout_s: float | None = None):
        """A new stream to ``peer`` for ``protocol`` (dials if needed) within ``timeout_s``."""
        if peer == self.peer_id:
            raise PeerUnreachable("refusing to open a stream to ourselves")
        try:
            with trio.fail_after(timeout_s or self.stream_timeout_s):
                return await self.libp2p.new_stream(_peer_id(peer), [protocol])
        except trio.TooSlowError:
            if self.link_kind(peer) == "relayed":
                # a circuit the relay cut (or a dead relay) can leave a connection that
                # never fails by itself: close it, so the next dial takes a live circuit
                self._spawn(self.disconnect, peer)
            raise PeerTimeout(f"new stream to {peer_id_to_b58(peer)[:16]} timed out") from None
        except trio.Cancelled:
            raise
        except Exception as exc:
            raise PeerUnreachable(f"stream to {peer_id_to_b58(peer)[:16]} failed: {exc}") from None

    # --- pooled streams --------------------------------------------------------------
    #
    # Opening a stream costs a multistream-select negotiation (two round trips plus
    # py-libp2p overhead: ~6 ms measured on loopback), which would dominate the cost of a
    # forwarding hop. For peers we forward to, we keep one spare stream negotiated ahead
    # of time. Spares idle longer than POOL_MAX_IDLE_S are reset (the server side waits
    # longer than that for a first frame); a spare that turns out dead is the caller's
    # to detect (write fails) and retry with a fresh stream.

    POOL_MAX_IDLE_S = 15.0

    async def take_stream(self, peer: bytes, protocol: str, timeout_s: float | None = None):
        """A ready stream from the pool, else a new one. Returns ``(stream, pooled)``.

        The caller calls :meth:`refill_pool` once its latency-critical part is over (the
        first response arrived): a refill's negotiation running concurrently with the
        request would otherwise add ~5 ms to it (measured)."""
        key = (peer, protocol)
        spares = self._pool.get(key)
        now = time.monotonic()
        stream = None
        while spares:
            candidate, opened_at = spares.pop()
            if now - opened_at < self.POOL_MAX_IDLE_S:
                stream = candidate
                break
            self._spawn(_reset_quietly, candidate)
        if stream is not None:
            self.pool_hits += 1
            return stream, True
        self.pool_misses += 1
        return await self.open_stream(peer, protocol, timeout_s), False

    def drop_pool(self, peer: bytes) -> None:
        """Forget (and reset) spare streams to ``peer`` (e.g. it went down)."""
        for key in [k for k in self._pool if k[0] == peer]:
            for stream, _ in self._pool.pop(key):
                self._spawn(_reset_quietly, stream)

    def _spawn(self, fn, *args) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(fn, *args)

    def refill_pool(self, peer: bytes, protocol: str) -> None:
        """Open one spare stream to ``peer`` in the background, unless one is ready."""
        key = (peer, protocol)
        if key in self._refilling or self._nursery is None or self._pool.get(key):
            return
        self._refilling.add(key)

        async def refill() -> None:
            try:
                stream = await self.open_stream(key[0], key[1])
            except HostError:
                return
            finally:
                self._refilling.discard(key)
            self._pool.setdefault(key, []).append((stream, time.monotonic()))
            await trio.sleep(self.POOL_MAX_IDLE_S)
            spares = self._pool.get(key, [])
            for item in list(spares):
                if item[0] is stream:
                    spares.remove(item)
                    await _reset_quietly(stream)

        self._nursery.start_soon(refill)

    def set_handler(self, protocol: str, handler: StreamHandler) -> None:
        """Register ``handler(stream)``; exceptions are logged, the stream is reset."""

        async def guarded(stream) -> None:
            try:
                await handler(stream)
            except trio.Cancelled:
                raise
            except Exception as exc:
                log.debug("handler %s: %s: %s", protocol, type(exc).__name__, exc)
                await _reset_quietly(stream)

        self.libp2p.set_stream_handler(protocol, guarded)


async def _reset_quietly(stream) -> None:
    with contextlib.suppress(Exception), trio.CancelScope(shield=True), trio.move_on_after(1):
        await stream.reset()


async def write_whole(stream, data: bytes, timeout_s: float) -> None:
    """Write ``data`` to a libp2p stream, shielded from cancellation from outside and
    bounded by ``timeout_s`` alone (``trio.TooSlowError`` past it).

    Why shielded: py-libp2p's Noise session encrypts a message, advancing its nonce, before
    it awaits the connection's write lock, so a cancellation that reaches that await drops
    an encrypted message: the peer can decrypt nothing more and resets the connection,
    every stream on it included (a request's deadline firing while a token was being
    relayed did that; ``tests/overlay/test_host.py`` reproduces it). A write that outlasts
    its own timeout is cut the same way, but a link that slow is lost anyway."""
    with trio.CancelScope(shield=True), trio.fail_after(timeout_s):
        await stream.write(data)


#: Benchmark-only link delay (seconds added to every frame this process sends), for
#: machines whose kernel has no netem (``bench swarm`` sets it through
#: ``bench/node_entry.py --link-delay-ms``). Each frame leaves ``delay`` after it was handed over,
#: and frames on one stream keep their order; a writer waits for its frame, so a stream
#: carries at most one frame per ``delay`` (TTFT sees the full delay, long token streams
#: are slowed more than by a real link). 0 in every real deployment.
_link_delay_s = 0.0


def set_link_delay(seconds: float) -> None:
    """Set the benchmark-only per-frame delay of this process (see ``_link_delay_s``)."""
    global _link_delay_s
    if not (0.0 <= seconds <= 10.0):
        raise ValueError(f"link delay must be in [0, 10] s, got {seconds!r}")
    _link_delay_s = float(seconds)


class FramedStream:
    """Reads and writes :mod:`wire` frames (or raw length-prefixed messages) on a libp2p
    stream, every operation under a deadline.

    Reads have two deadlines: ``timeout_s`` for each read (how long we wait for the next
    frame to begin, and for each chunk), and a **whole-frame** deadline: once a frame's
    first byte has arrived the frame must be complete within
    :func:`~.core.streamslots.frame_budget_s` of the size its length prefix announces
    (issue 14, finding 2: a peer trickling one byte every few seconds used to hold a
    stream forever). Past it :class:`FrameTimeout` (a :class:`PeerTimeout`) is raised."""

    def __init__(self, stream, *, timeout_s: float = 10.0):
        self.stream = stream
        self.timeout_s = timeout_s
        self._release_at = 0.0  # benchmark link delay: when the last frame left
        self.decoder = wire.FrameDecoder()
        self._raw = bytearray()
        self.bytes_in = 0
        self.bytes_out = 0
        self._frame_deadline: float | None = None  # trio clock; set at a frame's first byte

    @property
    def peer(self) -> bytes:
        return remote_peer(self.stream)

    async def _read_chunk(self, timeout_s: float | None) -> bytes | None:
        try:
            with trio.fail_after(self.timeout_s if timeout_s is None else timeout_s):
                data = await self.stream.read(_READ_CHUNK)
        except trio.TooSlowError:
            raise PeerTimeout("read timed out") from None
        except trio.Cancelled:
            raise
        except Exception:  # StreamEOF, StreamReset, closed muxer: all mean "gone"
            return None
        if not data:
            return None
        self.bytes_in += len(data)
        return data

    async def write_bytes(self, data: bytes, timeout_s: float | None = None) -> None:
        if _link_delay_s > 0.0:
            self._release_at = max(trio.current_time() + _link_delay_s, self._release_at)
            await trio.sleep_until(self._release_at)
        try:
            await write_whole(self.stream, data,
                              self.timeout_s if timeout_s is None else timeout_s)
        except trio.TooSlowError:
            raise PeerTimeout("write timed out") from None
        except trio.Cancelled:
            raise
        except Exception as exc:
            raise StreamClosedError(f"write failed: {type(exc).__name__}: {exc}") from None
        self.bytes_out += len(data)

    async def send(self, frame: wire.Frame, timeout_s: float | None = None) -> None:
        await self.write_bytes(wire.encode_frame(frame), timeout_s)

    def _frame_wait(self, buffered: bytes, max_bytes: int, timeout_s: float | None) -> float:
        """How long the next read may wait: the per-read timeout, or less when a partial
        frame is buffered (``buffered``: its bytes so far) and its whole-frame budget
        runs out sooner; raises :class:`FrameTimeout` once it has."""
        wait = self.timeout_s if timeout_s is None else timeout_s
        if not buffered:
            self._frame_deadline = None
            return wait
        now = trio.current_time()
        announced = (struct.unpack_from(">I", buffered)[0]
                     if len(buffered) >= wire.LENGTH_PREFIX_BYTES else None)
        if self._frame_deadline is None:
            self._frame_deadline = now + frame_budget_s(announced, max_bytes)
        left = self._frame_deadline - now
        if left <= 0:
            raise FrameTimeout(
                f"frame of {announced if announced is not None else 'unknown'} bytes not "
                f"complete within {frame_budget_s(announced, max_bytes):.1f} s "
                f"({len(buffered)} bytes arrived)")
        return min(wait, left)

    async def _read_within(self, wait: float) -> bytes | None:
        try:
            return await self._read_chunk(wait)
        except PeerTimeout:
            if self._frame_deadline is not None and trio.current_time() >= self._frame_deadline:
                raise FrameTimeout("frame not complete within its whole-frame budget") from None
            raise

    async def receive(self, timeout_s: float | None = None) -> wire.Frame | None:
        """Next frame; None at a clean end of stream. Raises :class:`wire.WireError`
        (malformed or truncated) or :class:`PeerTimeout` (also :class:`FrameTimeout`: a
        frame that began did not complete within its whole-frame budget)."""
        while True:
            frame = self.decoder.next_frame()
            if frame is not None:
                self._frame_deadline = None  # what is left buffered is a new frame
                return frame
            # the decoder's buffer (its length prefix tells the announced size)
            head = bytes(self.decoder._buf[: wire.LENGTH_PREFIX_BYTES])
            wait = self._frame_wait(head, wire.MAX_FRAME_BYTES, timeout_s)
            data = await self._read_within(wait)
            if data is None:
                self.decoder.eof()
                return None
            self.decoder.feed(data)

    async def send_raw(self, payload: bytes, timeout_s: float | None = None) -> None:
        if len(payload) > MAX_RAW_MESSAGE_BYTES:
            raise wire.OversizeFrame(
                f"message of {len(payload)} bytes exceeds {MAX_RAW_MESSAGE_BYTES}"
            )
        await self.write_bytes(struct.pack(">I", len(payload)) + payload, timeout_s)

    async def receive_raw(
        self, timeout_s: float | None = None, max_bytes: int = MAX_RAW_MESSAGE_BYTES
    ) -> bytes:
        """One length-prefixed message; raises :class:`StreamClosedError` at end of stream."""
        while True:
            if len(self._raw) >= 4:
                (length,) = struct.unpack_from(">I", self._raw)
                if length > max_bytes:
                    raise wire.OversizeFrame(f"message announces {length} bytes, limit {max_bytes}")
                if len(self._raw) >= 4 + length:
                    out = bytes(self._raw[4 : 4 + length])
                    del self._raw[: 4 + length]
                    self._frame_deadline = None  # what is left is a new message
                    return out
            wait = self._frame_wait(bytes(self._raw[:4]), max_bytes, timeout_s)
            data = await self._read_within(wait)
            if data is None:
                raise StreamClosedError("stream ended before a complete message")
            self._raw += data

    async def close(self) -> None:
        # shielded like write_whole: closing and resetting send a frame too
        with contextlib.suppress(Exception), trio.CancelScope(shield=True), \
                trio.move_on_after(1):
            await self.stream.close()

    async def reset(self) -> None:
        with contextlib.suppress(Exception), trio.CancelScope(shield=True), \
                trio.move_on_after(1):
            await self.stream.reset()


async def guarded_exchange(
    stats, prefix: str, timeout_s: float, call: Callable[[], Awaitable[object]], what: str
) -> bool:
    """Run one outgoing exchange of a digest protocol under ``timeout_s``; True when it
    completed. Expected failures (a timeout, a peer or wire error, records that failed
    verification) are counted in ``stats`` as ``<prefix>_timed_out`` / ``<prefix>_failed``;
    anything else is a bug, logged and counted ``<prefix>_crashed``, and never allowed to
    stop the caller's loop. Shared by ``overlay/gossip.py`` and ``overlay/partgossip.py``."""
    try:
        with trio.fail_after(timeout_s):
            await call()
        return True
    except trio.TooSlowError:
        stats[f"{prefix}_timed_out"] += 1
    except (HostError, wire.WireError, DigestError) as exc:
        stats[f"{prefix}_failed"] += 1
        log.debug("%s failed: %s", what, exc)
    except Exception:
        stats[f"{prefix}_crashed"] += 1
        log.exception("%s crashed", what)
    return False


class ResponderGate:
    """Per-peer admission for a protocol's responder, checked before a byte is read: at
    most ``max_open`` streams of one remote peer answered at once, and a token bucket
    (``limiter.allow(peer, now)``, e.g. :class:`~.trust.PeerRateLimiter`) on the streams it
    opens. A refused stream is reset unread (the initiator sees a failure at once) and
    counted in ``stats[concurrency_key]`` / ``stats[rate_key]``. Shared by the digest
    protocols (``overlay/gossip.py``, ``overlay/partgossip.py``)."""

    def __init__(self, limiter, max_open: int, clock: Callable[[], float], stats,
                 *, concurrency_key: str, rate_key: str) -> None:
        if isinstance(max_open, bool) or not isinstance(max_open, int) or max_open < 1:
            raise ValueError(f"max_open must be an int >= 1, got {max_open!r}")
        self.limiter = limiter
        self.max_open = max_open
        self.clock = clock  # monotonic: a wall-clock step must not freeze buckets
        self.stats = stats
        self.concurrency_key = concurrency_key
        self.rate_key = rate_key
        self.open: dict[bytes, int] = {}  # peer -> streams being answered now

    async def serve(self, stream, answer: Callable[[object, bytes], Awaitable[None]]) -> None:
        """Run ``answer(stream, peer)`` if the peer is within its limits, else refuse."""
        try:
            peer = remote_peer(stream)
        except Exception:  # a stream object without a connection (tests): one bucket
            peer = b""
        if self.open.get(peer, 0) >= self.max_open:
            self.stats[self.concurrency_key] += 1
            await self.refuse(stream)
            return
        if not self.limiter.allow(peer, self.clock()):
            self.stats[self.rate_key] += 1
            await self.refuse(stream)
            return
        self.open[peer] = self.open.get(peer, 0) + 1
        try:
            await answer(stream, peer)
        finally:
            left = self.open[peer] - 1
            if left:
                self.open[peer] = left
            else:
                del self.open[peer]

    @staticmethod
    async def refuse(stream) -> None:
        """Reset the stream unread."""
        with contextlib.suppress(Exception), trio.CancelScope(shield=True), \
                trio.move_on_after(1):
            await stream.reset()
