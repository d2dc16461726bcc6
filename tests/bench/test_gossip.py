"""bench/gossip.py: the simulator's side of one anti-entropy exchange, driven message by
message between two AntiEntropy states: after one exchange each side has applied the
other's records, a second exchange is the steady state (hash, "in sync", done: two tiny
messages), the bucketed variant converges too, and skipping decoding (``decode=False``,
the simulator's speed-up) changes nothing. (The real node's exchange: overlay/gossip.py.)"""

from __future__ import annotations

import pytest

from prefixmesh.bench import gossip
from prefixmesh.overlay.core.identity import Identity

MODEL = b"model-fp-test-00"
NS = b"N" * 8
NOW = 1_700_000_000.0
BUDGET = 64 * 1024


def _node(seed: int, k: int):
    ae = gossip.make_antientropy(Identity.from_seed(bytes([seed]) * 32), MODEL, now=NOW,
                                 ttl=900.0, refresh_interval=300.0)
    for j in range(k):
        ae.local_add_prefix(NS, [bytes([seed, j, i]) + b"\0" * 5 for i in range(3)])
    ae.tick(NOW + 1)
    return ae


def _exchange(a, b, *, decode=True, buckets=False):
    """Run one exchange a -> b; (messages, bytes, records a applied, records b applied)."""
    msg, sides, at = gossip.open_exchange(a), (b, a), 0
    messages = nbytes = 0
    applied = {id(a): [], id(b): []}
    while msg is not None:
        messages += 1
        nbytes += msg.nbytes
        receiver = sides[at % 2]
        msg, got, _ = gossip.handle(receiver, msg, NOW + 2, BUDGET, decode=decode,
                                    buckets=buckets)
        applied[id(receiver)].extend(got)
        at += 1
    return messages, nbytes, applied[id(a)], applied[id(b)]


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("buckets", [False, True])
def test_one_exchange_syncs_both_sides_then_two_messages_suffice(decode, buckets):
    a, b = _node(1, 3), _node(2, 2)
    assert a.summary_digest() != b.summary_digest()
    messages, _, got_a, got_b = _exchange(a, b, decode=decode, buckets=buckets)
    assert messages >= 3 and got_a and got_b
    assert {r.origin for r in got_a} == {b.identity.peer_id}
    assert {r.origin for r in got_b} == {a.identity.peer_id}
    assert a.summary_digest() == b.summary_digest()
    again = _exchange(a, b, decode=decode, buckets=buckets)
    assert again[0] == 2 and again[2:] == ([], [])  # hash, "in sync": nothing else


def test_without_the_hash_check_the_exchange_opens_with_the_summary():
    a = _node(1, 1)
    first = gossip.open_exchange(a, hash_check=False)
    assert first.kind == gossip.SUMMARY and first.nbytes == len(a.encoded_summary())
    assert gossip.open_exchange(a).kind == gossip.HASH
