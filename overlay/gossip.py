"""``/prefixmesh/digest/1.0.0``: periodic anti-entropy exchange of signed cache digests.

Every ``interval_s`` (default 1 s) the node

1. lets the daemon feed its cache changes and load into :class:`AntiEntropy`
   (``before_tick``) and issues its own due records (``AntiEntropy.tick``);
2. drops expired origins from the anti-entropy state and the :class:`PeerCacheIndex`;
3. runs the 3-message push-pull exchange (see :mod:`.antientropy`) with ``fanout`` peers
   drawn at random from the peers the heartbeat reports up, concurrently, each under
   ``exchange_timeout_s``.

Each message is one length-prefixed byte string (u32 big-endian) of at most
``max_message_bytes`` (default: twice the byte budget plus room for a full summary); a
longer announced length is refused before reading the body and counted as
``oversize_messages``. Records are verified by :meth:`AntiEntropy.receive` (signature,
signer = origin, sequence, replay, expiry, model) *before* anything reaches the peer
index; rejections are counted by error class (``AntiEntropy.stats["rejected"]``) and
never stop the node. Records carry their origin's listen addresses, so a relayed origin
becomes dialable: ``on_learn(origin, addrs)`` hands them to discovery (gossip finds
peers too).

Budget: each side sends at most ``byte_budget`` bytes of records per exchange.

Choosing peers: heartbeat PONGs and SWIM ACKs carry each peer's summary hash when it
changes (``peer_hash``); a round contacts only up to ``fanout`` peers whose hash differs
from ours, plus one random peer every ``backstop_rounds`` rounds (a stale or lost report
cannot stall convergence for long). A peer found in sync by an exchange (either side's
summary-hash check) counts as in sync too until our own summary changes
(``_synced``): SWIM reports a peer's hash only on the ACKs to our own probes, once per
N periods, so without this a node whose summary changed kept re-checking peers that had
long caught up (about 3 exchanges per second per node at N=32, each costing a libp2p
stream, ~0.7 KB). In steady state almost no exchange runs at all.

Steady state: before the 3 messages the initiator sends a 16-byte hash of its summary
(``[0, hash]``); the responder answers ``[0, true]`` when its own summary hashes the same
(both hold exactly the same records: nothing to exchange, about 40 bytes in all) and
``[0, false]`` otherwise, and the 3-message exchange follows on the same stream. Converged
nodes therefore pay for summaries only when some origin issued a new record.

Limits per peer (responder side, checked before a byte of the stream is read): a remote
peer may hold at most ``max_exchanges_per_peer`` (2) responder exchanges open at once,
and may open exchanges at most at ``exchange_rate_per_s`` (4/s) with bursts of
``exchange_burst`` (8) (a :class:`~.core.limits.PeerRateLimiter` on ``limit_clock``, monotonic
by default). Over either, the stream is reset unread and counted as
``exchanges_concurrency_limited`` / ``exchanges_rate_limited``; the initiator sees a
failed exchange and tries again in a later round. Why these never throttle an honest
peer: an honest initiator contacts any one responder at most once per round (``fanout``
distinct peers plus one backstop peer not among them), rounds are sequential and at least
``interval_s`` apart, and an exchange ends (or times out after ``exchange_timeout_s``)
before the next round starts; so it opens at most ``1 / interval_s`` exchanges per second
with us and holds one at a time. 4/s covers every interval down to 0.25 s (the default is
1 s; tests run 0.3-0.5 s); the burst of 8 absorbs rounds that bunch up (a slow round
followed by fast ones). Nodes running a shorter ``interval_s`` need a higher rate
(``[limits].digest_exchange_rate``; the daemon warns). The concurrency bound of 2 leaves
room for one exchange whose responder half is still finishing after the initiator gave up
on it.

What one exchange can make the responder do is bounded too: each message is at most
``max_message_bytes`` (384 KiB with the default budget), so message 3 carries at most
about 1,800 records (the smallest signed record is 212 bytes; also at most
``MAX_RECORDS_PER_MESSAGE`` = 4096), each verified (one Ed25519 check) before it is
applied; records already held are skipped unverified. Measured: verifying a maximal
message of fresh junk records took 0.44-0.54 s of CPU on a shared 2-core development
machine. An honest peer sends at most its ``byte_budget`` of records, so a records
message longer than *our* ``byte_budget`` is charged to the sender's exchange bucket:
one more token per further ``byte_budget`` (capped at the burst), taken before anything
is verified; a peer that cannot pay has the message dropped unverified
(``records_rate_limited``) and resends in a later exchange. With the defaults a hostile
peer thus gets about 4 x 64 KiB of records verified per second (about 0.3 s of CPU per
second on that machine) instead of 4 x 384 KiB; a peer with a larger budget than ours
still gets through, at a slower pace.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import trio

from .core import wire
from .core.antientropy import AntiEntropy, ReceiveResult
from .core.exchange import (
    MSG_BUCKETS,
    MSG_SCOPED_SUMMARY,
    AntiEntropyError,
    ScopedSummary,
    bucket_count,
    decode_buckets,
    decode_records,
    decode_reply,
    decode_scoped_summary,
    decode_summary,
    decode_summary_hash,
    encode_buckets,
    encode_records,
    encode_reply,
    encode_scoped_summary,
    encode_summary_hash,
    peek_message_type,
    summary_hash,
)
from .core.limits import PeerRateLimiter
from .core.peerindex import PeerCacheIndex
from .digestexchange import ExchangeSettings
from .host import FramedStream, HostError, OverlayHost, ResponderGate, guarded_exchange

__all__ = ["Gossip", "summary_hash"]



def _decode_hash_message(data: bytes) -> bytes | bool | None:
    """The summary-hash message, or None if malformed (counted by the caller)."""
    try:
        return decode_summary_hash(data)
    except AntiEntropyError:
        return None


log = logging.getLogger(__name__)

#: peers remembered as in sync with our current summary (each one authenticated and
#: through the exchange limits; the set empties whenever our summary changes)
_MAX_SYNCED_PEERS = 4096


class Gossip:
    """Full replication's digest exchange (a :class:`~.digestexchange.DigestExchange`)."""

    def __init__(
        self,
        host: OverlayHost,
        ae: AntiEntropy,
        index: PeerCacheIndex,
        *,
        peers: Callable[[], Sequence[bytes]],
        on_learn: Callable[[bytes, Sequence[str]], None] | None = None,
        before_tick: Callable[[float], None] | None = None,
        settings: ExchangeSettings | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.time,
        peer_hash: Callable[[bytes], bytes] | None = None,
        limit_clock: Callable[[], float] = time.monotonic,
        **overrides: Any,
    ):
        # overrides: single ExchangeSettings fields by keyword (tests, benchmarks)
        s = self.settings = dataclasses.replace(settings or ExchangeSettings(), **overrides)
        self.host = host
        self.ae = ae
        self.index = index
        self.peers = peers
        self.on_learn = on_learn
        self.before_tick = before_tick
        # run-time copies: benchmarks switch some of them between phases (bench/overlay.py)
        self.interval_s = s.interval_s
        self.fanout = s.fanout
        self.byte_budget = s.byte_budget
        self.exchange_timeout_s = s.exchange_timeout_s
        self.max_message_bytes = s.max_message_bytes or (2 * s.byte_budget + 256 * 1024)
        self.rng = rng or random.Random()
        self.clock = clock
        # send a summary hash first (saves the summaries when in sync); responders accept
        # both openings, so this is a per-initiator choice (the benchmark compares them)
        self.summary_hash_check = s.summary_hash_check
        # peers' summary hashes as their heartbeats report them (b"": unknown). When
        # given, a round contacts only peers whose hash differs from ours, plus one random
        # peer every ``backstop_rounds`` rounds in case a report is stale or lost.
        self.peer_hash = peer_hash
        self.backstop_rounds = s.backstop_rounds
        # responder: answer a differing summary hash with bucket hashes (message 7) so
        # that only the differing buckets' entries are exchanged. Initiators always accept
        # both answers; turn this on once every node runs code that does.
        self.bucket_summaries = s.bucket_summaries
        self.own_hash = b""
        # peers an exchange found holding our current summary; cleared when it changes
        self._synced: set[bytes] = set()
        self.rounds = 0
        self.stats: Counter[str] = Counter()
        self._want_snapshots: set[bytes] = set()
        self.last_heard: dict[bytes, float] = {}  # origin -> wall time of its last applied record
        # responder-side limits per remote peer (module docstring, "Limits per peer")
        max_exchanges_per_peer = s.max_exchanges_per_peer
        if isinstance(max_exchanges_per_peer, bool) or not isinstance(max_exchanges_per_peer, int) \
                or max_exchanges_per_peer < 1:
            raise ValueError(f"max_exchanges_per_peer must be an int >= 1, "
                             f"got {max_exchanges_per_peer!r}")
        self.exchange_limiter = PeerRateLimiter(s.exchange_rate_per_s, s.exchange_burst)
        self.max_exchanges_per_peer = max_exchanges_per_peer
        self.limit_clock = limit_clock  # monotonic: a wall-clock step must not freeze buckets
        self._gate = ResponderGate(self.exchange_limiter, max_exchanges_per_peer, limit_clock,
                                   self.stats, concurrency_key="exchanges_concurrency_limited",
                                   rate_key="exchanges_rate_limited")

    # --- running ---------------------------------------------------------------------

    def register(self) -> None:
        self.host.set_handler(wire.DIGEST_PROTOCOL, self.handle)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.register()
        task_status.started()
        while True:
            try:
                await self.round()
            except Exception:  # never let one bad round stop the digest loop
                self.stats["rounds_crashed"] += 1
                log.exception("digest round failed")
            await trio.sleep(self.interval_s)

    def tick(self) -> None:
        now = self.clock()
        if self.before_tick is not None:
            self.before_tick(now)
        self.ae.tick(now)
        for origin in self.ae.expire(now):
            self.index.drop_peer(origin)
            self.last_heard.pop(origin, None)
        self.index.expire(now)
        self._rehash()

    def _rehash(self) -> None:
        own = self.ae.summary_digest()  # cached until the summary changes
        if own != self.own_hash:
            self._synced.clear()
        self.own_hash = own

    def _note_synced(self, peer: bytes, digest: bytes) -> None:
        """``peer`` holds the summary whose hash is ``digest`` (an exchange said so)."""
        if digest == self.own_hash and len(self._synced) < _MAX_SYNCED_PEERS:
            self._synced.add(peer)

    # --- the DigestExchange interface (overlay/digestexchange.py) ----------------------

    def advertised_hash(self) -> bytes:
        return self.own_hash

    def node_stats(self) -> dict[str, int]:
        out = {f"digest_{k}": int(v) for k, v in self.stats.items()}
        out["digest_rounds"] = self.rounds
        return out

    async def round(self) -> None:
        self.tick()
        candidates = [p for p in self.peers() if p != self.host.peer_id]
        if self.peer_hash is not None:
            behind = [p for p in candidates
                      if p not in self._synced and self.peer_hash(p) != self.own_hash]
            chosen = self.rng.sample(behind, min(self.fanout, len(behind)))
            rest = [p for p in candidates if p not in chosen]
            if rest and self.fanout and self.rounds % self.backstop_rounds == 0:
                chosen.append(self.rng.choice(rest))
            self.stats["peers_skipped_in_sync"] += len(candidates) - len(behind)
        else:
            chosen = self.rng.sample(candidates, min(self.fanout, len(candidates)))
        async with trio.open_nursery() as nursery:
            for peer in chosen:
                nursery.start_soon(self._exchange_guarded, peer)
        self.rounds += 1

    async def _exchange_guarded(self, peer: bytes) -> None:
        if await guarded_exchange(self.stats, "exchanges", self.exchange_timeout_s,
                                  lambda: self.exchange(peer), "digest exchange"):
            self.stats["exchanges_ok"] += 1

    # --- the exchange ----------------------------------------------------------------

    async def exchange(self, peer: bytes) -> None:
        """Initiator side: summary -> (records + summary + wants) -> records."""
        stream = await self.host.open_stream(peer, wire.DIGEST_PROTOCOL, self.exchange_timeout_s)
        fs = FramedStream(stream, timeout_s=self.exchange_timeout_s)
        try:
            scope = None
            if self.summary_hash_check:
                sent_digest = self.ae.summary_digest()
                await self._send(fs, encode_summary_hash(sent_digest))
                answer = await self._receive(fs)
                verdict = _decode_hash_message(answer)
                if verdict is True:
                    self.stats["exchanges_in_sync"] += 1
                    self._note_synced(peer, sent_digest)
                    return
                if verdict is None and peek_message_type(answer) == MSG_BUCKETS:
                    theirs = decode_buckets(answer)  # bounded, validated
                    k = len(theirs)
                    ours = self.ae.bucket_hashes(k)
                    differ = tuple(i for i in range(k) if ours[i] != theirs[i])
                    scope = (k, differ)  # empty: in sync by now, the reply will be empty
                    scoped = ScopedSummary(k, differ, self.ae.scoped_summary(k, differ))
                    await self._send(fs, encode_scoped_summary(scoped))
                elif verdict is not False:
                    self.stats["malformed_messages"] += 1
                    raise wire.MalformedFrame("bad summary-hash answer")
            if scope is None:
                await self._send(fs, self.ae.encoded_summary())
            reply = decode_reply(await self._receive(fs))
            self._apply(self.ae.receive(reply.records, self.clock(), sender=peer))
            records = self.ae.records_for(
                reply.summary, self.byte_budget, reply.want_snapshots, scope=scope
            )
            await self._send(fs, encode_records(records))
        except AntiEntropyError:
            self.stats["malformed_messages"] += 1
            raise
        finally:
            with trio.CancelScope(shield=True):
                await fs.close()

    async def handle(self, stream) -> None:
        """Responder side: refuse a peer over its limits before reading a byte, else answer."""
        await self._gate.serve(stream, self._answer)

    async def _answer(self, stream, peer: bytes) -> None:
        fs = FramedStream(stream, timeout_s=self.exchange_timeout_s)
        try:
            with trio.fail_after(self.exchange_timeout_s * 2):
                first = await self._receive(fs)
                theirs = _decode_hash_message(first)
                if isinstance(theirs, bytes):  # summary-hash check first
                    same = theirs == self.ae.summary_digest()
                    if same:
                        self._note_synced(peer, theirs)
                    if same or not self.bucket_summaries:
                        await self._send(fs, encode_summary_hash(same))
                    else:
                        k = bucket_count(self.ae.summary_size())
                        await self._send(fs, encode_buckets(self.ae.bucket_hashes(k)))
                    if same:
                        self.stats["exchanges_in_sync"] += 1
                        return
                    first = await self._receive(fs)
                want = sorted(self._want_snapshots)[:256]
                if peek_message_type(first) == MSG_SCOPED_SUMMARY:
                    scoped = decode_scoped_summary(first)  # bounded, validated
                    scope = (scoped.k, scoped.buckets)
                    records = self.ae.records_for(scoped.entries, self.byte_budget, scope=scope)
                    ours = self.ae.scoped_summary(scoped.k, scoped.buckets)
                    message = encode_reply(records, ours, want)
                else:
                    summary = decode_summary(first)
                    records = self.ae.records_for(summary, self.byte_budget)
                    message = self.ae.encode_reply(records, want)
                self._want_snapshots.difference_update(want)
                await self._send(fs, message)
                data = await self._receive(fs)
                if not self._pay_for_records(peer, len(data)):
                    self.stats["records_rate_limited"] += 1
                    return  # dropped unverified; the peer resends in a later exchange
                raws = decode_records(data)
                self._apply(self.ae.receive(raws, self.clock(), sender=peer))
            self.stats["exchanges_answered"] += 1
        except AntiEntropyError:
            self.stats["malformed_messages"] += 1
        except wire.OversizeFrame:
            pass  # counted in _receive
        except (HostError, wire.WireError, trio.TooSlowError) as exc:
            log.debug("digest exchange (responder) failed: %s", exc)
            self.stats["exchanges_failed"] += 1
        except Exception:
            self.stats["exchanges_crashed"] += 1
            log.exception("digest exchange (responder) crashed")
        finally:
            with contextlib.suppress(Exception), trio.CancelScope(shield=True):
                await fs.close()

    def _pay_for_records(self, peer: bytes, n_bytes: int) -> bool:
        """Charge the peer's exchange bucket for a records message beyond our own budget.

        An honest peer with our ``byte_budget`` never pays; each further ``byte_budget``
        of records costs one more exchange token (capped at the burst, so a large but
        lawful message is never refused forever)."""
        extra = max(0, n_bytes - self.byte_budget) / self.byte_budget
        if extra == 0:
            return True
        cost = min(extra, self.exchange_limiter.burst)
        return self.exchange_limiter.allow(peer, self.limit_clock(), cost)

    async def _send(self, fs: FramedStream, payload: bytes) -> None:
        self.stats["bytes_out"] += len(payload) + 4
        await fs.send_raw(payload)

    async def _receive(self, fs: FramedStream) -> bytes:
        try:
            data = await fs.receive_raw(max_bytes=self.max_message_bytes)
        except wire.OversizeFrame:
            self.stats["oversize_messages"] += 1
            raise
        self.stats["bytes_in"] += len(data) + 4
        return data

    def _apply(self, result: ReceiveResult) -> None:
        now = self.clock()
        for record in result.applied:
            try:
                self.index.apply(record, now)
            except ValueError as exc:  # verified but not indexable: count, keep going
                self.stats["index_errors"] += 1
                log.warning("peer index refused a record: %s", exc)
                continue
            self.last_heard[record.origin] = now
            if self.on_learn is not None and record.addrs:
                self.on_learn(record.origin, record.addrs)
        self._want_snapshots.update(result.need_snapshot)
        if result.applied:
            self._rehash()
        self.stats["records_applied"] += len(result.applied)
        self.stats["records_rejected"] += len(result.rejected)

    def rejected_by_class(self) -> dict[str, int]:
        return dict(self.ae.stats["rejected"])
