"""The simulator's side of one anti-entropy exchange: real messages, real bytes.

This is the thin driver a host would also need: it calls ``AntiEntropy`` and the
``encode_*``/``decode_*`` codecs of ``overlay/antientropy.py`` and nothing else, so the
bytes the simulator counts are the bytes a real node would put on the wire (minus
libp2p stream framing). Exchange, as the real node's ``overlay/gossip.py`` runs it:

0. A -> B hash of A's summary; B -> A "in sync?" (true ends the exchange: the steady
   state costs two tiny messages); A -> B, when not in sync:
1. A -> B summary;  2. B -> A records A lacks + B's summary;  3. A -> B records B lacks
   (omitted when there are none).

(The real node also learns peers' summary hashes from heartbeat PONGs and skips in-sync
peers before opening an exchange at all; the simulator has no heartbeats, so its digest
byte counts are an upper bound of the real node's.)

Every message is encoded (its length is what the simulator counts). With
``decode=False`` the receiver uses the object the sender encoded instead of decoding the
bytes again: the codecs round-trip exactly (``decode_x(encode_x(v)) == v``, which
``tests/test_sim.py`` checks on whole runs by comparing both modes), and skipping the
bounded CBOR scan of every summary roughly halves the simulator's gossip cost. Records
themselves are always decoded and verified by ``AntiEntropy.receive``.
"""

from __future__ import annotations

from prefixmesh.overlay.antientropy import (
    AntiEntropy,
    decode_records,
    decode_reply,
    decode_summary,
    decode_summary_hash,
    encode_records,
    encode_reply,
    encode_summary,
    encode_summary_hash,
    summary_hash,
)
from prefixmesh.overlay.digest import DigestRecord
from prefixmesh.overlay.identity import Identity

__all__ = ["Message", "make_antientropy", "open_exchange", "handle"]

HASH, HASH_ANSWER, SUMMARY, REPLY, RECORDS = 10, 11, 1, 2, 3


class Message:
    __slots__ = ("kind", "data", "nbytes", "value")

    def __init__(self, kind: int, data: bytes, value: object = None) -> None:
        self.kind = kind
        self.data = data
        self.nbytes = len(data)
        self.value = value  # what was encoded (used when the receiver skips decoding)


def make_antientropy(
    identity: Identity, model_fp: bytes, *, now: float, ttl: float, refresh_interval: float
) -> AntiEntropy:
    return AntiEntropy(
        identity, model_fp, epoch=1, now=now, ttl=ttl, refresh_interval=refresh_interval
    )


def open_exchange(ae: AntiEntropy, *, hash_check: bool = True) -> Message:
    """The first message of an exchange started by ``ae``."""
    summary = ae.summary()
    if hash_check:
        digest = summary_hash(summary)
        return Message(HASH, encode_summary_hash(digest), digest)
    return Message(SUMMARY, encode_summary(summary), summary)


def handle(
    ae: AntiEntropy, msg: Message, now: float, budget_bytes: int, *, decode: bool = True
) -> tuple[Message | None, list[DigestRecord], list[bytes]]:
    """Process ``msg`` at ``ae``: (reply or None, records applied, origins dropped)."""
    if msg.kind == HASH:
        theirs = decode_summary_hash(msg.data) if decode else msg.value
        same = theirs == summary_hash(ae.summary())
        return Message(HASH_ANSWER, encode_summary_hash(same), same), [], []
    if msg.kind == HASH_ANSWER:
        in_sync = decode_summary_hash(msg.data) if decode else msg.value
        if in_sync is True:
            return None, [], []
        return open_exchange(ae, hash_check=False), [], []
    if msg.kind == SUMMARY:
        theirs = decode_summary(msg.data) if decode else msg.value
        records = ae.records_for(theirs, budget_bytes)
        summary = ae.summary()
        raws = [r.raw for r in records]
        data = encode_reply(raws, summary)
        return Message(REPLY, data, (raws, summary, frozenset())), [], []
    if msg.kind == REPLY:
        if decode:
            reply = decode_reply(msg.data)
            raws, summary, want = reply.records, reply.summary, reply.want_snapshots
        else:
            raws, summary, want = msg.value
        result = ae.receive(raws, now)
        records = ae.records_for(summary, budget_bytes, want)
        back = None
        if records:
            out = [r.raw for r in records]
            back = Message(RECORDS, encode_records(out), out)
        return back, result.applied, []
    result = ae.receive(decode_records(msg.data) if decode else msg.value, now)
    return None, result.applied, []
