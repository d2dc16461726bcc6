"""The simulator's side of one anti-entropy exchange: real messages, real bytes.

This is the thin driver a host would also need: it calls ``AntiEntropy`` and the
``encode_*``/``decode_*`` codecs of ``overlay/core/antientropy.py`` and nothing else, so the
bytes the simulator counts are the bytes a real node would put on the wire (minus
libp2p stream framing). Exchange, as the real node's ``overlay/gossip.py`` runs it:

0. A -> B hash of A's summary; B -> A "in sync?" (true ends the exchange: the steady
   state costs two tiny messages); A -> B, when not in sync:
1. A -> B summary;  2. B -> A records A lacks + B's summary;  3. A -> B records B lacks
   (omitted when there are none).

(The real node also learns peers' summary hashes from heartbeat PONGs and skips in-sync
peers before opening an exchange at all; the simulator has no heartbeats, so its digest
byte counts are an upper bound of the real node's.)

Opt-in variant (``SimConfig.bucket_summaries``, see ``overlay/core/exchange.py``): B
answers a differing hash with its bucket hashes (message 7) instead of ``false``, A sends
its entries of the differing buckets (8), B replies with records and its entries there
(2), A sends records (3).

Every message is encoded (its length is what the simulator counts). With
``decode=False`` the receiver uses the object the sender encoded instead of decoding the
bytes again: the codecs round-trip exactly (``decode_x(encode_x(v)) == v``, which
``tests/bench/test_sim.py`` checks on whole runs by comparing both modes), and skipping the
bounded CBOR scan of every summary roughly halves the simulator's gossip cost. Records
themselves are always decoded and verified by ``AntiEntropy.receive``.
"""

from __future__ import annotations

from prefixmesh.overlay.core.antientropy import AntiEntropy
from prefixmesh.overlay.core.digest import DigestRecord
from prefixmesh.overlay.core.exchange import (
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
)
from prefixmesh.overlay.core.identity import Identity

__all__ = ["Message", "make_antientropy", "open_exchange", "handle"]

HASH, HASH_ANSWER, SUMMARY, REPLY, RECORDS = 10, 11, 1, 2, 3
BUCKETS, SCOPED_SUMMARY = 7, 8


class Message:
    __slots__ = ("kind", "data", "nbytes", "value", "scope")

    def __init__(self, kind: int, data: bytes, value: object = None, scope=None) -> None:
        self.kind = kind
        self.data = data
        self.nbytes = len(data)
        self.value = value  # what was encoded (used when the receiver skips decoding)
        # a reply to a scoped summary: the (k, buckets) the initiator chose, which a real
        # initiator keeps in its exchange state (not on the wire)
        self.scope = scope


def make_antientropy(
    identity: Identity,
    model_fp: bytes,
    *,
    now: float,
    ttl: float,
    refresh_interval: float,
    min_record_interval: float = 0.0,
    compaction_ratio: float = 1.0,
) -> AntiEntropy:
    return AntiEntropy(
        identity, model_fp, epoch=1, now=now, ttl=ttl, refresh_interval=refresh_interval,
        min_record_interval=min_record_interval, compaction_ratio=compaction_ratio,
    )  # fmt: skip


def _summary_message(ae: AntiEntropy) -> Message:
    return Message(SUMMARY, ae.encoded_summary(), ae.summary())


def open_exchange(ae: AntiEntropy, *, hash_check: bool = True) -> Message:
    """The first message of an exchange started by ``ae``."""
    if hash_check:
        digest = ae.summary_digest()
        return Message(HASH, encode_summary_hash(digest), digest)
    return _summary_message(ae)


def handle(
    ae: AntiEntropy,
    msg: Message,
    now: float,
    budget_bytes: int,
    *,
    decode: bool = True,
    buckets: bool = False,
) -> tuple[Message | None, list[DigestRecord], list[bytes]]:
    """Process ``msg`` at ``ae``: (reply or None, records applied, origins dropped).
    ``buckets``: a responder answers a differing summary hash with its bucket hashes
    (message 7) and the exchange compares only the differing buckets' entries."""
    kind = msg.kind
    if kind == HASH:
        theirs = decode_summary_hash(msg.data) if decode else msg.value
        same = theirs == ae.summary_digest()
        if buckets and not same:
            hashes = ae.bucket_hashes(bucket_count(ae.summary_size()))
            return Message(BUCKETS, encode_buckets(hashes), hashes), [], []
        return Message(HASH_ANSWER, encode_summary_hash(same), same), [], []
    if kind == BUCKETS:
        theirs = decode_buckets(msg.data) if decode else msg.value
        k = len(theirs)
        ours = ae.bucket_hashes(k)
        differ = tuple(i for i in range(k) if ours[i] != theirs[i])
        if not differ:  # in sync after all (a record arrived meanwhile)
            return None, [], []
        scoped = ScopedSummary(k, differ, ae.scoped_summary(k, differ))
        return Message(SCOPED_SUMMARY, encode_scoped_summary(scoped), scoped), [], []
    if kind == SCOPED_SUMMARY:
        sc: ScopedSummary = decode_scoped_summary(msg.data) if decode else msg.value
        scope = (sc.k, sc.buckets)
        raws = [r.raw for r in ae.records_for(sc.entries, budget_bytes, scope=scope)]
        ours = ae.scoped_summary(sc.k, sc.buckets)
        data = encode_reply(raws, ours)
        return Message(REPLY, data, (raws, ours, frozenset()), scope=scope), [], []
    if kind == HASH_ANSWER:
        in_sync = decode_summary_hash(msg.data) if decode else msg.value
        if in_sync is True:
            return None, [], []
        return _summary_message(ae), [], []
    if kind == SUMMARY:
        theirs = decode_summary(msg.data) if decode else msg.value
        records = ae.records_for(theirs, budget_bytes)
        raws = [r.raw for r in records]
        data = ae.encode_reply(raws)
        return Message(REPLY, data, (raws, ae.summary(), frozenset())), [], []
    if kind == REPLY:
        if decode:
            reply = decode_reply(msg.data)
            raws, summary, want = reply.records, reply.summary, reply.want_snapshots
        else:
            raws, summary, want = msg.value
        result = ae.receive(raws, now)
        back = None
        records = ae.records_for(summary, budget_bytes, want, scope=msg.scope)
        if records:
            out = [r.raw for r in records]
            back = Message(RECORDS, encode_records(out), out)
        return back, result.applied, []
    result = ae.receive(decode_records(msg.data) if decode else msg.value, now)
    return None, result.applied, []
