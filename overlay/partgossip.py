"""``/prefixmesh/digest-part/1.0.0``: partial replication of cache digests (the trio shell
of :mod:`.partition`).

Opt-in (``[digest].partitions > 0``); the node then runs this instead of :mod:`.gossip`.
All decisions (partitions, homes, what to push, what a lookup answers) are
:class:`~.partition.PartitionedDigest`'s; this module only moves its messages.

Every ``interval_s`` the node

1. lets the daemon feed its cache changes and load (``before_tick``) and issues its own
   due records (``PartitionedDigest.tick``);
2. sends every due push (``PartitionedDigest.pushes``) to its home: one length-prefixed
   message out (:func:`~.partition.encode_push`), one back (:func:`~.partition.encode_ack`,
   fed to ``receive_ack``), under ``exchange_timeout_s``. Homes are pushed to
   concurrently, each home's pushes one after another; after a failure the rest of that
   home's pushes wait for the pure code's resend timer (a dead home costs one timeout per
   round, not one per push).

Push streams are kept open and reused: opening a libp2p stream (multistream-select
negotiation, Yamux, Noise frames) cost about 700 bytes on the wire per push, more than
the records it carried (measured: N=16 under load, 0.85 KB/s of payload became 2.0 KB/s
on the wire). The initiator keeps one stream per home, closes it after ``stream_idle_s``
unused, and discards it on any error (a push that fails on a reused stream is retried
once on a fresh one: the responder may have closed it meanwhile); the responder answers
messages on a stream one after another until the initiator closes it, or for at most
``2 x stream_idle_s`` of silence. Every message after a stream's first is charged to the
peer's rate bucket like a new stream.

Members (whom partitions' homes are drawn from) are the peers the heartbeat reports up,
plus this node. A push to a node that is not a home in *its* view of the members is
refused (``NotAHome``): the stream is closed unanswered and the origin resends later.
So is a push past the home's byte budgets across partitions (``OverBudget``; counted in
``over_budget``).

Lookups (:meth:`PartitionGossip.lookup`): a router that is not a home of a request's
partition sends a home the chain (:func:`~.partition.encode_lookup`) and gets the holders
(:func:`~.partition.encode_lookup_answer`); answers are kept in :attr:`lookup_cache`
(:class:`~.partition.LookupCache`) and their load figures folded into the digest state.

Responder limits per remote peer, checked before a byte is read (as in :mod:`.gossip`):
at most ``max_open_per_peer`` streams answered at once and ``request_rate_per_s`` /
``request_burst`` streams opened (a :class:`~.core.limits.PeerRateLimiter`, one bucket for
pushes and lookups). Why these defaults (64/s, burst 256, 8 open) never throttle an honest
peer in practice: an origin sends at most one push per (partition, home) per round and
one at a time per home, so a burst is bounded by the partitions it has new prefixes in;
a router looks up at most once per entering request whose answer it has not cached.
A refused origin resends after ``PartitionConfig.resend_after_s``; a refused lookup is a
routing miss (served locally), never a wrong answer.

Bad input (undecodable message, unknown type, wrong partition, a push to a non-home,
records that fail verification) is counted in :attr:`stats` and the stream is closed;
nothing a peer sends stops the loop or the responder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import trio

from .core import wire
from .core.digest import DigestError
from .core.exchange import peek_message_type
from .core.limits import PeerRateLimiter
from .core.partition import (
    MAX_PARTITION_MESSAGE_BYTES,
    MSG_LOOKUP,
    MSG_PUSH,
    HolderMatch,
    LookupCache,
    NotAHome,
    OverBudget,
    PartitionedDigest,
    PartitionMessageError,
    Push,
    decode_ack,
    decode_lookup,
    decode_lookup_answer,
    decode_push,
    encode_ack,
    encode_lookup,
    encode_lookup_answer,
    encode_push,
)
from .digestexchange import ExchangeSettings
from .host import (
    FramedStream,
    HostError,
    OverlayHost,
    PeerTimeout,
    ResponderGate,
    StreamClosedError,
    guarded_exchange,
)

__all__ = ["PartitionGossip"]

log = logging.getLogger(__name__)


class PartitionGossip:
    """Partial replication's digest exchange (a :class:`~.digestexchange.DigestExchange`)."""

    def __init__(
        self,
        host: OverlayHost,
        pd: PartitionedDigest,
        *,
        peers: Callable[[], Sequence[bytes]],
        on_learn: Callable[[bytes, Sequence[str]], None] | None = None,
        before_tick: Callable[[float], None] | None = None,
        settings: ExchangeSettings | None = None,
        clock: Callable[[], float] = time.time,
        limit_clock: Callable[[], float] = time.monotonic,
        **overrides: Any,
    ):
        # overrides: single ExchangeSettings fields by keyword (tests, benchmarks)
        s = self.settings = dataclasses.replace(settings or ExchangeSettings(), **overrides)
        self.host = host
        self.pd = pd
        self.peers = peers
        self.on_learn = on_learn
        self.before_tick = before_tick
        self.interval_s = s.interval_s
        self.byte_budget = s.byte_budget
        self.exchange_timeout_s = s.exchange_timeout_s
        self.clock = clock
        self.stats: Counter[str] = Counter()
        self.limiter = PeerRateLimiter(s.request_rate_per_s, s.request_burst)
        self.limit_clock = limit_clock  # monotonic: a wall-clock step must not freeze buckets
        self._gate = ResponderGate(self.limiter, s.max_open_per_peer, limit_clock, self.stats,
                                   concurrency_key="concurrency_limited",
                                   rate_key="rate_limited")
        self.stream_idle_s = s.stream_idle_s
        # open push streams: home -> (stream, monotonic time of last use)
        self._push_streams: dict[bytes, tuple[FramedStream, float]] = {}
        self.rounds = 0
        self.last_heard: dict[bytes, float] = {}  # origin -> wall time of its last applied record

    @property
    def lookup_cache(self) -> LookupCache:
        """The digest state's cache of lookup answers (shared with the router)."""
        return self.pd.lookup_cache

    # --- the DigestExchange interface (overlay/digestexchange.py) ----------------------

    def advertised_hash(self) -> bytes:
        return b""  # no single summary: each partition's stream has its own

    def node_stats(self) -> dict[str, int]:
        out = {f"part_{k}": int(v) for k, v in self.stats.items()}
        out["part_rounds"] = self.rounds
        out["part_streams"] = len(self.pd.streams)
        out["part_lookup_cache_hits"] = self.lookup_cache.hits
        out["part_lookup_cache_misses"] = self.lookup_cache.misses
        rejected: Counter[str] = Counter()
        for ae in self.pd.streams.values():
            rejected.update({k: int(v) for k, v in ae.stats["rejected"].items()})
        out.update({f"part_rejected_{k}": v for k, v in rejected.items()})
        return out

    # --- membership --------------------------------------------------------------------

    def members(self) -> list[bytes]:
        """The nodes partitions' homes are drawn from (``PartitionedDigest.homes`` adds us)."""
        return [p for p in self.peers() if p != self.host.peer_id]

    def homes_of(self, ns: bytes, chain: Sequence[bytes]) -> tuple[int, list[bytes]]:
        p = self.pd.partition(ns, chain)
        return p, self.pd.homes(p, self.members())

    # --- running -----------------------------------------------------------------------

    def register(self) -> None:
        self.host.set_handler(wire.PARTITION_PROTOCOL, self.handle)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.register()
        task_status.started()
        try:
            while True:
                try:
                    await self.round()
                except Exception:  # never let one bad round stop the digest loop
                    self.stats["rounds_crashed"] += 1
                    log.exception("partition digest round failed")
                await trio.sleep(self.interval_s)
        finally:
            with trio.CancelScope(shield=True):
                for home in list(self._push_streams):
                    await self._drop_stream(home)

    def tick(self) -> None:
        now = self.clock()
        if self.before_tick is not None:
            self.before_tick(now)
        issued = self.pd.tick(now)
        self.stats["records_issued"] += len(issued)

    async def round(self) -> None:
        self.tick()
        idle_before = time.monotonic() - self.stream_idle_s
        for home, (_, used) in list(self._push_streams.items()):
            if used < idle_before:
                await self._drop_stream(home)
        pushes = self.pd.pushes(self.clock(), self.members(), self.byte_budget)
        by_home: dict[bytes, list[Push]] = {}
        for push in pushes:
            by_home.setdefault(push.home, []).append(push)
        async with trio.open_nursery() as nursery:
            for home, items in by_home.items():
                nursery.start_soon(self._push_to_home, home, items)
        self.rounds += 1

    async def _push_to_home(self, home: bytes, items: list[Push]) -> None:
        for i, push in enumerate(items):
            if not await self._push_guarded(push):
                self.stats["pushes_deferred"] += len(items) - i - 1
                return

    async def _push_guarded(self, push: Push) -> bool:
        ok = False
        try:
            ok = await guarded_exchange(self.stats, "pushes", self.exchange_timeout_s,
                                        lambda: self.push(push), "partition push")
        finally:
            if not ok:  # whatever went wrong, the stream's state is unknown: never reuse it
                with trio.CancelScope(shield=True):
                    await self._drop_stream(push.home)
        return ok

    # --- initiator side ----------------------------------------------------------------

    async def push(self, push: Push) -> None:
        """Send one push to its home (on the open stream to it, if any) and apply the
        acknowledgement."""
        message = encode_push(push.partition, push.records)
        held = self._push_streams.get(push.home)
        if held is not None:
            try:
                data = await self._exchange_on(held[0], message)
                self.stats["push_streams_reused"] += 1
            except (StreamClosedError, PeerTimeout):
                # the responder closed it meanwhile (idle) or it died: once more, fresh
                await self._drop_stream(push.home)
                held = None
        if held is None:
            stream = await self.host.open_stream(
                push.home, wire.PARTITION_PROTOCOL, self.exchange_timeout_s
            )
            fs = FramedStream(stream, timeout_s=self.exchange_timeout_s)
            self._push_streams[push.home] = (fs, time.monotonic())
            self.stats["push_streams_opened"] += 1
            data = await self._exchange_on(fs, message)
        self._push_streams[push.home] = (self._push_streams[push.home][0], time.monotonic())
        try:
            p, entries = decode_ack(data)
        except PartitionMessageError:
            self.stats["malformed"] += 1
            raise
        if p != push.partition:
            self.stats["malformed"] += 1
            raise PartitionMessageError(f"ack for partition {p}, pushed {push.partition}")
        self.pd.receive_ack(push.home, p, entries)
        self.stats["acks"] += 1

    async def _exchange_on(self, fs: FramedStream, message: bytes) -> bytes:
        await self._send(fs, message)
        self.stats["pushes_sent"] += 1
        return await self._receive(fs)

    async def _drop_stream(self, home: bytes) -> None:
        held = self._push_streams.pop(home, None)
        if held is not None:
            with trio.CancelScope(shield=True):
                await held[0].close()

    async def lookup(
        self, home: bytes, ns: bytes, chain: Sequence[bytes], timeout_s: float
    ) -> list[HolderMatch] | None:
        """Ask ``home`` who holds ``chain``; None on any failure (a routing miss). The
        answer is cached (:attr:`lookup_cache`) and its load figures noted."""
        if not chain:
            return []
        p = self.pd.partition(ns, chain)
        self.stats["lookups_sent"] += 1
        try:
            with trio.fail_after(timeout_s):
                stream = await self.host.open_stream(home, wire.PARTITION_PROTOCOL, timeout_s)
                fs = FramedStream(stream, timeout_s=timeout_s)
                try:
                    await self._send(fs, encode_lookup(p, ns, chain))
                    holders = decode_lookup_answer(await self._receive(fs))
                finally:
                    with trio.CancelScope(shield=True):
                        await fs.close()
        except trio.TooSlowError:
            self.stats["lookups_timed_out"] += 1
            return None
        except PartitionMessageError as exc:
            self.stats["malformed"] += 1
            self.stats["lookups_failed"] += 1
            log.debug("partition lookup answer malformed: %s", exc)
            return None
        except (HostError, wire.WireError, DigestError) as exc:
            self.stats["lookups_failed"] += 1
            log.debug("partition lookup failed: %s", exc)
            return None
        self.stats["lookup_answers"] += 1
        self.pd.take_answer(ns, chain, holders, self.clock())
        return holders

    # --- responder side ----------------------------------------------------------------

    async def handle(self, stream) -> None:
        """Refuse a peer over its limits before reading a byte, else answer its messages."""
        await self._gate.serve(stream, self._answer)

    async def _answer(self, stream, peer: bytes) -> None:
        """Answer messages one after another until the initiator closes the stream or it
        stays silent for ``2 x stream_idle_s``; each message after the first is charged
        to the peer's rate bucket (the first was, when the stream opened)."""
        fs = FramedStream(stream, timeout_s=self.exchange_timeout_s)
        first = True
        try:
            while True:
                if first:
                    with trio.fail_after(self.exchange_timeout_s * 2):
                        data = await self._receive(fs)
                else:
                    try:
                        data = await self._receive(fs, timeout_s=2 * self.stream_idle_s)
                    except (StreamClosedError, PeerTimeout):
                        return  # the initiator is done with this stream
                    if not self.limiter.allow(peer, self.limit_clock()):
                        self.stats["rate_limited"] += 1
                        return
                first = False
                with trio.fail_after(self.exchange_timeout_s * 2):
                    await self._answer_one(fs, peer, data)
        except NotAHome as exc:
            self.stats["refused"] += 1
            log.debug("partition push refused: %s", exc)
        except OverBudget as exc:
            self.stats["over_budget"] += 1
            log.debug("partition push refused: %s", exc)
        except PartitionMessageError as exc:
            self.stats["malformed"] += 1
            log.debug("partition message malformed: %s", exc)
        except DigestError as exc:  # verified records that could not be applied
            self.stats["digest_errors"] += 1
            log.debug("partition push rejected: %s", exc)
        except wire.OversizeFrame:
            self.stats["oversize_messages"] += 1
        except (HostError, wire.WireError, trio.TooSlowError) as exc:
            self.stats["answers_failed"] += 1
            log.debug("partition answer failed: %s", exc)
        except Exception:
            self.stats["answers_crashed"] += 1
            log.exception("partition answer crashed")
        finally:
            with contextlib.suppress(Exception), trio.CancelScope(shield=True):
                await fs.close()

    async def _answer_one(self, fs: FramedStream, peer: bytes, data: bytes) -> None:
        kind = peek_message_type(data)
        if kind == MSG_PUSH:
            await self._answer_push(fs, peer, data)
        elif kind == MSG_LOOKUP:
            p, ns, chain = decode_lookup(data)
            holders = self.pd.lookup(p, ns, chain)  # raises PartitionMessageError if p is bad
            await self._send(fs, encode_lookup_answer(holders))
            self.stats["lookups_answered"] += 1
        else:
            raise PartitionMessageError(f"unexpected message type {kind!r}")

    async def _answer_push(self, fs: FramedStream, peer: bytes, data: bytes) -> None:
        p, raws = decode_push(data)
        now = self.clock()
        entries, applied = self.pd.receive_push(peer, p, raws, now, self.members())
        self.stats["pushes_received"] += 1
        self.stats["records_applied"] += len(applied)
        for record in applied:
            self.last_heard[record.origin] = now
            if self.on_learn is not None and record.addrs:
                self.on_learn(record.origin, record.addrs)
        await self._send(fs, encode_ack(p, entries))

    # --- framing -----------------------------------------------------------------------

    async def _send(self, fs: FramedStream, payload: bytes) -> None:
        self.stats["bytes_out"] += len(payload) + wire.LENGTH_PREFIX_BYTES
        await fs.send_raw(payload)

    async def _receive(self, fs: FramedStream, timeout_s: float | None = None) -> bytes:
        data = await fs.receive_raw(timeout_s, max_bytes=MAX_PARTITION_MESSAGE_BYTES)
        self.stats["bytes_in"] += len(data) + wire.LENGTH_PREFIX_BYTES
        return data
