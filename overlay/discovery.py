"""Finding peers: a directory of known peers fed by bootstrap, gossip, mDNS and the DHT.

Sources
    1. bootstrap multiaddrs from the config (retried with backoff until connected);
    2. digest records: every record carries its origin's listen addrs, so gossip relays
       make peers we never configured dialable (see :mod:`.gossip`);
    3. mDNS on the LAN (switchable; :class:`MdnsDiscovery`); py-libp2p's callback runs on
       zeroconf's thread and is bridged into trio with ``trio.from_thread.run_sync``;
    4. a Kademlia DHT in server mode (:class:`DhtDiscovery`): the node announces itself
       as a provider under a key derived from its model fingerprint and under one key
       common to the whole mesh (:func:`mesh_key`: every model), and periodically looks
       up the providers of both (its own model's first), so a node also finds nodes of
       other models, which it passes their models' requests to; our own DHT records are
       signed by their writer and checked by a namespace validator whose ``select()``
       prefers the newest valid one.

Every learned peer goes to :class:`PeerDirectory`, which remembers its addresses and how
we learned it, and calls ``on_new_peer`` for a new peer or new addresses of a known one
(the daemon starts the heartbeat for it, which connects; watching is idempotent). A full
directory evicts its least valuable peer for a newcomer (never seen up, most crowded /24,
oldest: :mod:`.core.admission`), and forgets a peer the heartbeat gave up on. Limits: :data:`MAX_PEERS` known peers,
:data:`MAX_ADDRS_PER_PEER` addresses each; addresses that are unspecified (0.0.0.0)
or not TCP multiaddrs are ignored.

Our own peer id met at an address that is not ours (``PeerDirectory.self_addrs``) means
another node runs with a copy of our key file: peers cannot tell the two apart, so the
directory logs an ERROR naming both addresses (once per foreign address).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import trio

from .core.admission import NEVER_UP, Merit, MeritTable
from .core.identity import IdentityError, peer_id_to_b58, public_key_from_peer_id
from .core.limits import subnet_of_multiaddr
from .core.relaying import transport_part
from .host import HostError, OverlayHost, split_p2p_addr

__all__ = [
    "KnownPeer",
    "PeerDirectory",
    "bootstrap_loop",
    "browse_mdns",
    "find_lan_nodes",
    "MAX_PEERS",
    "MAX_ADDRS_PER_PEER",
]

log = logging.getLogger(__name__)

MAX_PEERS = 1024
MAX_ADDRS_PER_PEER = 8


@dataclass
class KnownPeer:
    peer: bytes
    addrs: list[str] = field(default_factory=list)
    sources: set[str] = field(default_factory=set)
    first_seen: float = 0.0


def _subnet(addrs: Sequence[str]) -> str | None:
    for a in addrs:
        s = subnet_of_multiaddr(a.split("/p2p/")[0])
        if s is not None:
            return s
    return None


def _usable(addr: str) -> bool:
    return (
        addr.startswith(("/ip4/", "/ip6/", "/dns"))
        and "/tcp/" in addr
        and "/ip4/0.0.0.0/" not in addr
    )


class PeerDirectory:
    def __init__(self, self_id: bytes, on_new_peer: Callable[[bytes], None] | None = None,
                 self_addrs: Callable[[], Sequence[str]] = list):
        self.self_id = self_id
        self.on_new_peer = on_new_peer
        self.self_addrs = self_addrs  # our own transport addrs (the daemon sets it)
        self.peers: dict[bytes, KnownPeer] = {}
        self.invalid_ids = 0  # peer ids ignored because they are not Ed25519 identities
        self.impostor_addrs: set[str] = set()  # where another node used our peer id
        # admission by merit when full (the daemon sets it to the heartbeat's verdict)
        self.merit: Callable[[bytes], int] = lambda peer: NEVER_UP
        self.evicted = 0

    def learn(self, peer: bytes, addrs: Sequence[str], source: str) -> bool:
        """Record ``peer`` at ``addrs`` (transport addrs, no /p2p part). True if new."""
        if peer == self.self_id:
            self._met_self(addrs, source)
            return False
        known = self.peers.get(peer)
        new = known is None
        if new:
            if len(self.peers) >= MAX_PEERS and not self._evict_for(addrs):
                return False
            try:  # only Ed25519 identities can sign digests: ignore any other kind
                public_key_from_peer_id(peer)
            except (IdentityError, TypeError, ValueError):
                self.invalid_ids += 1
                log.debug("ignored a peer id that is not an Ed25519 identity (via %s)", source)
                return False
            known = self.peers[peer] = KnownPeer(peer, first_seen=time.time())
        known.sources.add(source)
        added = False
        for a in addrs:
            a = transport_part(a)  # a circuit address keeps its relay's /p2p/R
            if _usable(a) and a not in known.addrs:
                known.addrs.insert(0, a)  # newest first
                added = True
        del known.addrs[MAX_ADDRS_PER_PEER:]
        if new:
            log.info("learned peer %s via %s", peer_id_to_b58(peer)[-8:], source)
        # also on new addresses of a known peer: the heartbeat may have given up on it
        # (down for too long) and should try again (its watch() is idempotent)
        if (new or added) and self.on_new_peer is not None:
            self.on_new_peer(peer)
        return new

    def forget(self, peer: bytes) -> None:
        """Drop ``peer`` (the heartbeat gave up on it: it never answered)."""
        self.peers.pop(peer, None)

    def _evict_for(self, addrs: Sequence[str]) -> bool:
        """Full directory: evict the least valuable peer (core/admission.py) if a
        never-seen-up newcomer at ``addrs`` is worth as much; True if room was made."""
        table = MeritTable(MAX_PEERS)
        for p, k in self.peers.items():
            table.put(p, Merit(0, _subnet(k.addrs), k.first_seen))
        victim = table.victim(Merit(NEVER_UP, _subnet(addrs), time.time()),
                              merit_now=self.merit)
        if victim is None:
            return False
        del self.peers[victim]
        self.evicted += 1
        return True

    def _met_self(self, addrs: Sequence[str], source: str) -> None:
        own = {a.split("/p2p/")[0] for a in self.self_addrs()}
        own_hosts = {a.split("/tcp/")[0] for a in own}
        for a in addrs:
            a = a.split("/p2p/")[0]
            # a DNS name may well be our own address: only IP addresses can be compared;
            # mDNS/DHT may still hold our previous run's record (another port on one of
            # our own IPs), so only the configured bootstrap list counts a port there
            stale_self = source != "bootstrap" and a.split("/tcp/")[0] in own_hosts
            if (not _usable(a) or a.startswith("/dns") or a in own or stale_self
                    or a in self.impostor_addrs
                    or len(self.impostor_addrs) >= MAX_ADDRS_PER_PEER):
                continue
            self.impostor_addrs.add(a)
            log.error(
                "another node uses this node's peer id %s: it is at %s (learned via %s), "
                "this node is at %s; each node needs its own key file (was it copied?)",
                peer_id_to_b58(self.self_id), a, source, ", ".join(sorted(own)) or "?",
            )

    def addrs_of(self, peer: bytes) -> list[str]:
        known = self.peers.get(peer)
        return list(known.addrs) if known else []

    def sources_of(self, peer: bytes) -> set[str]:
        known = self.peers.get(peer)
        return set(known.sources) if known else set()


async def bootstrap_loop(
    host: OverlayHost,
    directory: PeerDirectory,
    addrs: Sequence[str],
    *,
    retry_min_s: float = 0.5,
    retry_max_s: float = 15.0,
) -> None:
    """Learn each bootstrap peer and connect to it, retrying failed ones with backoff
    until each has been reached once (the heartbeat keeps the connection afterwards)."""
    pending: dict[bytes, str] = {}
    for a in addrs:
        try:
            peer, transport = split_p2p_addr(a)
        except Exception as exc:
            log.warning("ignoring bootstrap address %s: %s", a, exc)
            continue
        if peer != host.peer_id:
            pending[peer] = transport
        directory.learn(peer, [transport], "bootstrap")  # our own id: checked there
    delay = retry_min_s
    failures: dict[bytes, int] = {}
    while pending:
        for peer, transport in list(pending.items()):
            try:
                await host.connect(peer, [transport])
                del pending[peer]
                if failures.pop(peer, 0):
                    log.info("bootstrap peer %s reached", transport)
            except HostError as exc:
                # one WARNING, then quiet retries: a peer that is down for an hour must
                # not fill the log (libp2p's own lines about it are at DEBUG)
                n = failures[peer] = failures.get(peer, 0) + 1
                log.log(logging.WARNING if n == 1 else logging.DEBUG,
                        "bootstrap peer %s not reachable (%s); retrying every %.0f s at most",
                        transport, exc, retry_max_s)
        if pending:
            await trio.sleep(delay)
            delay = min(delay * 2, retry_max_s)


# --- mDNS ---------------------------------------------------------------------------------


MDNS_SERVICE_TYPE = "_p2p._udp.local."  # what py-libp2p's MDNSDiscovery announces
_MAX_LAN_ADDRS = 64
_MAX_ADDR_CHARS = 256


def browse_mdns(timeout_s: float = 3.0, *, service_type: str = MDNS_SERVICE_TYPE) -> list[str]:
    """Full multiaddrs (``.../p2p/ID``) that libp2p nodes on the LAN announce over mDNS.

    Blocking (zeroconf runs its own thread); a light client uses it through
    :func:`find_lan_nodes`. It only *browses*: a client serves nothing, so unlike
    :class:`MdnsDiscovery` it announces nothing. Returns as soon as one node answered, or
    an empty list after ``timeout_s``. TXT values are untrusted input: only bounded,
    dialable ``/ip4|/ip6 .../tcp/N/p2p/ID`` strings are kept (the Noise handshake then
    proves the peer id).
    """
    from zeroconf import ServiceBrowser, ServiceListener, Zeroconf

    found: list[str] = []
    lock = threading.Lock()
    answered = threading.Event()

    class _Listener(ServiceListener):
        def add_service(self, zc: Zeroconf, type_: str, name: str) -> None:
            info = zc.get_service_info(type_, name, timeout=1500)
            if info is None:
                return
            for key, value in (info.properties or {}).items():
                if not (isinstance(key, bytes) and key.startswith(b"dnsaddr") and value):
                    continue
                addr = value.decode("utf-8", "replace")
                if (len(addr) <= _MAX_ADDR_CHARS and "/p2p/" in addr and "/tcp/" in addr
                        and addr.startswith(("/ip4/", "/ip6/"))
                        and not addr.startswith(("/ip4/0.0.0.0/", "/ip6/::/"))):
                    with lock:
                        if len(found) < _MAX_LAN_ADDRS:
                            found.append(addr)
                    answered.set()

        def update_service(self, zc: Zeroconf, type_: str, name: str) -> None:
            self.add_service(zc, type_, name)

        def remove_service(self, zc: Zeroconf, type_: str, name: str) -> None:
            pass

    zc = Zeroconf()
    try:
        browser = ServiceBrowser(zc, service_type, _Listener())
        try:
            answered.wait(timeout_s)
        finally:
            browser.cancel()
    finally:
        zc.close()
    with lock:
        return sorted(set(found))


async def find_lan_nodes(timeout_s: float = 3.0) -> list[str]:
    """:func:`browse_mdns` from trio (in a worker thread, abandoned if cancelled)."""
    return await trio.to_thread.run_sync(lambda: browse_mdns(timeout_s), abandon_on_cancel=True)


class MdnsDiscovery:
    """LAN discovery with py-libp2p's mDNS (zeroconf). Needs concrete (non-0.0.0.0) listen
    addresses: they are what the TXT records advertise. Discovered peers are learned with
    source ``"mdns"``; the zeroconf thread's callback is bridged into trio."""

    def __init__(self, host: OverlayHost, directory: PeerDirectory, addrs: Sequence[str]):
        self.host = host
        self.directory = directory
        self.addrs = [a.split("/p2p/")[0] for a in addrs]
        self.discovered = 0
        self.stop_timeout_s = 1.0  # of the node's 3 s shutdown budget
        self._mdns = None

    async def run(self) -> None:
        """Runs until cancelled; a LAN without multicast only disables mDNS (logged)."""
        try:
            await self._run()
        except Exception as exc:
            log.warning("mDNS discovery stopped: %s: %s", type(exc).__name__, exc)

    async def _run(self) -> None:
        from libp2p.discovery.events.peerDiscovery import peerDiscovery
        from libp2p.discovery.mdns.mdns import MDNSDiscovery

        token = trio.lowlevel.current_trio_token()
        port = 0
        for a in self.addrs:
            if "/tcp/" in a:
                port = int(a.split("/tcp/")[1].split("/")[0])
                break
        me = self.host.identity.peer_id_b58

        def on_thread(peer_info) -> None:  # zeroconf's thread
            peer = peer_info.peer_id.to_bytes()
            addrs = [str(a) for a in peer_info.addrs]
            try:
                trio.from_thread.run_sync(self._learn, peer, addrs, trio_token=token)
            except trio.RunFinishedError:
                pass

        full = [f"{a}/p2p/{me}" for a in self.addrs]
        self._mdns = await trio.to_thread.run_sync(
            lambda: MDNSDiscovery(
                self.host.libp2p.get_network(), port=port, listen_addrs=full, host=self.host.libp2p
            )
        )
        peerDiscovery.register_peer_discovered_handler(on_thread)
        try:
            self._mdns.start()
            await trio.sleep_forever()
        finally:
            peerDiscovery.unregister_peer_discovered_handler(on_thread)
            mdns, self._mdns = self._mdns, None
            await _stop_mdns(mdns, self.stop_timeout_s)

    def _learn(self, peer: bytes, addrs: list[str]) -> None:
        if peer != self.host.peer_id:
            self.discovered += 1
        # our own id too: the directory reports another node running with our identity
        self.directory.learn(peer, addrs, "mdns")


async def _stop_mdns(mdns, timeout_s: float) -> None:
    """Stop py-libp2p's MDNSDiscovery without hanging the node's shutdown.

    Its ``stop()`` cancels a trio cancel scope, so it must run on the trio thread (from a
    worker thread it raised "must be called from async context" before closing zeroconf,
    and the node never exited); the rest (goodbye packets, zeroconf's own thread) is
    blocking, so it runs in a worker thread, abandoned after ``timeout_s``."""
    scope = getattr(mdns, "_cleanup_cancel_scope", None)
    if scope is not None:
        scope.cancel()
        mdns._cleanup_cancel_scope = None
    with trio.CancelScope(shield=True), trio.move_on_after(timeout_s) as waited:
        await trio.to_thread.run_sync(mdns.stop, abandon_on_cancel=True)
    if waited.cancelled_caught:
        log.info("mDNS did not stop within %.1f s; leaving it to exit with the process",
                 timeout_s)


# --- Kademlia DHT -------------------------------------------------------------------------

DHT_NAMESPACE = "prefixmesh"
_DHT_RECORD_LABEL = b"prefixmesh/dht-record/v1\x00"
MAX_DHT_RECORD_BYTES = 4096


def providers_key(model_fp: bytes) -> str:
    """The DHT provider key of all nodes serving one model: a sha2-256 multihash (hex)."""
    import hashlib

    digest = hashlib.sha256(b"prefixmesh/providers/v1\x00" + bytes(model_fp)).digest()
    return "1220" + digest.hex()


def mesh_key() -> str:
    """The DHT provider key every node announces, whatever its model (many models in one
    mesh: a node finds nodes of other models through it; their models come in PONGs)."""
    import hashlib

    return "1220" + hashlib.sha256(b"prefixmesh/mesh/v1").digest().hex()


#: providers taken from each key per round (own model, then the mesh key)
MAX_PROVIDERS_PER_KEY = 32
#: how often a node announces itself again when nothing changed. DHT records live 24 h
#: (values) and 48 h (provider records) in py-libp2p; an announce is a lookup plus a
#: stream to each of the k = 20 closest peers, and announcing every 10 s made DHT upkeep
#: the largest idle cost of a node (5-7 % of a core per node at N=16, growing with N)
REANNOUNCE_S = 1800.0
#: provider lookups back off to this interval while they find nobody new (membership
#: spreads the mesh's members too: the DHT is for joining and for healing a split)
MAX_FIND_INTERVAL_S = 120.0
#: ... but not while the node is new: for this long after its first round it announces
#: and looks up every round (as every node once did all the time). Records placed while
#: the routing tables are still filling can miss the peers that later lookups ask (a
#: single announce was measured to leave a 4-node mesh's newest node unfound for 90 s on a
#: loaded machine), and the peers a new node should find announce seconds after it
JOIN_ROUNDS_S = 120.0


def encode_dht_record(identity, addrs: Sequence[str], issued_at: float) -> bytes:
    """A signed ``{peer, addrs, issued_at}`` record: canonical CBOR ``[body, signature]``."""
    import cbor2

    body = cbor2.dumps(
        [identity.peer_id, list(addrs)[:MAX_ADDRS_PER_PEER], float(issued_at)], canonical=True
    )
    return cbor2.dumps([body, identity.sign(_DHT_RECORD_LABEL + body)], canonical=True)


class DhtRecordError(ValueError):
    """A DHT record that is malformed, too big, or not signed by the peer it names."""


#: how far a record's issued_at may lie ahead of our clock: a record "from the future"
#: would win ``select`` over every later record its owner publishes (a stolen key or a
#: broken clock could pin a peer's address record forever)
MAX_DHT_RECORD_SKEW_S = 300.0


def decode_dht_record(
    key: str, value: bytes, now: float | None = None
) -> tuple[bytes, list[str], float]:
    """Validate a record stored under ``/prefixmesh/<peer b58>``; raises DhtRecordError.

    ``issued_at`` must be finite and at most :data:`MAX_DHT_RECORD_SKEW_S` ahead of
    ``now`` (default: the wall clock)."""
    import cbor2

    from .core.identity import peer_id_from_b58, verify_signature

    if len(value) > MAX_DHT_RECORD_BYTES:
        raise DhtRecordError("record too large")
    try:
        body, sig = cbor2.loads(value)
        peer, addrs, issued_at = cbor2.loads(body)
    except Exception as exc:
        raise DhtRecordError(f"malformed record: {exc}") from None
    if (
        not isinstance(peer, bytes)
        or not isinstance(sig, bytes)
        or not isinstance(addrs, list)
        or not isinstance(issued_at, float)
        or not all(isinstance(a, str) for a in addrs)
    ):
        raise DhtRecordError("malformed record fields")
    if not math.isfinite(issued_at):
        raise DhtRecordError(f"issued_at must be finite, got {issued_at!r}")
    now = time.time() if now is None else now
    if issued_at > now + MAX_DHT_RECORD_SKEW_S:
        raise DhtRecordError(
            f"issued_at {issued_at:.0f} is {issued_at - now:.0f} s in the future "
            f"(at most {MAX_DHT_RECORD_SKEW_S:.0f} s accepted)"
        )
    expected = key.rsplit("/", 1)[-1]
    try:
        key_peer = peer_id_from_b58(expected)
    except ValueError as exc:
        raise DhtRecordError(f"bad key {key!r}: {exc}") from None
    if key_peer != peer:
        raise DhtRecordError("record names another peer than its key")
    if not verify_signature(peer, _DHT_RECORD_LABEL + body, sig):
        raise DhtRecordError("bad signature (the writer is not the peer named by the key)")
    return peer, addrs, issued_at


class PrefixmeshValidator:
    """libp2p namespace validator: a record must be signed by the peer its key names;
    ``select`` prefers the newest valid record (the library default keeps the first)."""

    def validate(self, key: str, value: bytes) -> None:
        decode_dht_record(key, value)

    def select(self, key: str, values: list[bytes]) -> int:
        best, best_t = 0, -1.0
        for i, v in enumerate(values):
            try:
                _, _, t = decode_dht_record(key, v)
            except DhtRecordError:
                continue
            if t > best_t:
                best, best_t = i, t
        return best


class DhtDiscovery:
    """Kademlia DHT in server mode: announce as a provider of the model key and of the
    mesh key, find others.

    Every ``interval_s`` (first rounds faster): add connected peers to the routing table;
    announce (provider records + our signed address record under
    ``/prefixmesh/<our b58 id>``) when due (:meth:`_announce_due`: every round while
    joining, :data:`JOIN_ROUNDS_S`; then on new addresses, a routing table twice as large
    as at the last announce, or :data:`REANNOUNCE_S` since); ``find_providers`` of our
    model's key, then of the mesh key (at most :data:`MAX_PROVIDERS_PER_KEY` each) every
    round while joining and while that finds someone new, backing off to
    :data:`MAX_FIND_INTERVAL_S` while it finds nobody; providers without
    addresses are resolved through their signed record (or ``find_peer``). Found peers are
    learned with source ``"dht"``. Every DHT call runs under ``op_timeout_s``.
    """

    def __init__(
        self,
        host: OverlayHost,
        directory: PeerDirectory,
        model_fp: bytes,
        *,
        interval_s: float = 10.0,
        op_timeout_s: float = 5.0,
        connected=None,
    ):
        self.host = host
        self.directory = directory
        self.key = providers_key(model_fp)
        self.keys = (self.key, mesh_key())  # announced and looked up, own model first
        self.interval_s = interval_s
        self.op_timeout_s = op_timeout_s
        self.connected = connected or host.connected_peers
        self.dht = None
        self.found = 0
        self.rounds = 0
        self.announces = 0
        self.finds = 0
        # (when, routing table size, addresses) of the last announce; None: never
        self._announced: tuple[float, int, tuple[str, ...]] | None = None
        self._next_find = 0.0
        self._find_interval = interval_s
        self._first_round: float | None = None

    async def run(self) -> None:
        """Runs until cancelled; a DHT failure only disables DHT discovery (logged)."""
        try:
            await self._run()
        except Exception as exc:
            log.warning("DHT discovery stopped: %s: %s", type(exc).__name__, exc)

    async def _run(self) -> None:
        from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
        from libp2p.peer.id import ID
        from libp2p.tools.anyio_service import background_trio_service

        self.dht = KadDHT(self.host.libp2p, DHTMode.SERVER)
        self.dht.register_validator(DHT_NAMESPACE, PrefixmeshValidator())
        async with background_trio_service(self.dht):
            delay = 1.0
            while True:
                try:
                    await self._round(ID)
                except Exception as exc:  # a DHT failure never stops the node
                    log.debug("dht round failed: %s: %s", type(exc).__name__, exc)
                self.rounds += 1
                await trio.sleep(delay)
                delay = min(delay * 2, self.interval_s)

    async def _round(self, ID) -> None:
        dht = self.dht
        for peer in self.connected():
            with trio.move_on_after(self.op_timeout_s):
                await dht.add_peer(ID(peer))
        table = dht.get_routing_table_size()
        if table == 0:
            return
        now = trio.current_time()
        if self._first_round is None:
            self._first_round = now
        addrs = tuple(sorted(self.host.listen_addrs()))
        if self._announce_due(now, table, addrs):
            self.announces += 1
            if await self._announce(addrs):  # one that failed or timed out: again next round
                self._announced = (now, table, addrs)
        if now >= self._next_find:
            self.finds += 1
            if await self._find() or now - self._first_round < JOIN_ROUNDS_S:
                self._find_interval = self.interval_s
                self._next_find = now  # more may be coming in: look again next round
            else:
                self._next_find = now + self._find_interval
                self._find_interval = min(self._find_interval * 2, MAX_FIND_INTERVAL_S)

    def _announce_due(self, now: float, table: int, addrs: tuple[str, ...]) -> bool:
        """Whether to announce again: never announced, still joining
        (:data:`JOIN_ROUNDS_S`), our addresses changed (a relay reservation, a mapped
        port), the routing table doubled (peers closer to the keys than those holding our
        records may have joined), or :data:`REANNOUNCE_S` passed."""
        if self._announced is None or now - self._first_round < JOIN_ROUNDS_S:
            return True
        when, at_table, at_addrs = self._announced
        return addrs != at_addrs or table >= 2 * at_table or now - when >= REANNOUNCE_S

    async def _announce(self, addrs: Sequence[str]) -> bool:
        """Provider records under our keys and our signed address record; True when every
        one of them reached some peer within ``op_timeout_s``."""
        dht = self.dht
        me = self.host.identity.peer_id_b58
        ok = True
        for key in self.keys:
            provided = False
            with trio.move_on_after(self.op_timeout_s):
                provided = bool(await dht.provide(key))
            ok = ok and provided
        stored = False
        with trio.move_on_after(self.op_timeout_s):
            await dht.put_value(f"/{DHT_NAMESPACE}/{me}",
                                encode_dht_record(self.host.identity, list(addrs), time.time()))
            stored = True
        return ok and stored

    async def _find(self) -> int:
        """Looks up the providers of our keys; returns how many peers were new to us."""
        providers, seen = [], set()
        for key in self.keys:
            with trio.move_on_after(self.op_timeout_s):
                for info in await self.dht.find_providers(key, MAX_PROVIDERS_PER_KEY):
                    if info.peer_id not in seen:
                        seen.add(info.peer_id)
                        providers.append(info)
        new = 0
        for info in providers:
            peer = info.peer_id.to_bytes()
            if peer == self.host.peer_id:
                continue
            addrs = [str(a) for a in info.addrs]
            if not addrs:
                addrs = await self._resolve(peer)
            if addrs and self.directory.learn(peer, addrs, "dht"):
                self.found += 1
                new += 1
        return new

    async def _resolve(self, peer: bytes) -> list[str]:
        from libp2p.peer.id import ID

        b58 = peer_id_to_b58(peer)
        with trio.move_on_after(self.op_timeout_s):
            value = await self.dht.get_value(f"/{DHT_NAMESPACE}/{b58}")
            if value:
                try:
                    _, addrs, _ = decode_dht_record(f"/{DHT_NAMESPACE}/{b58}", value)
                    return addrs
                except DhtRecordError as exc:
                    log.info("ignoring DHT record of %s: %s", b58[-8:], exc)
        with trio.move_on_after(self.op_timeout_s):
            info = await self.dht.find_peer(ID(peer))
            if info is not None:
                return [str(a) for a in info.addrs]
        return []
