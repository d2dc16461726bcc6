"""overlay/core/models.py (names, catalog, resolve) and the wire fields that carry models."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.overlay.core import models as m
from prefixmesh.overlay.core import wire as w

fps = st.binary(min_size=1, max_size=m.MAX_MODEL_FP_BYTES)
names = st.text(alphabet=sorted(m.NAME_CHARS), min_size=1,
                max_size=m.MAX_MODEL_NAME_CHARS).filter(m.valid_model_name)
announcements = st.lists(st.tuples(st.sampled_from([b"A" * 16, b"B" * 16, b"C" * 16]) | fps,
                                   names | st.text(max_size=80)), max_size=40)


def test_names_from_paths():
    fp = bytes(range(16))
    assert m.model_name_from_path("/x/SmolLM2-135M-Instruct.Q4_1.gguf", fp) == \
        "SmolLM2-135M-Instruct.Q4_1"
    assert m.model_name_from_path("C:\\m\\tiny.GGUF", fp) == "tiny"
    for bad in (None, "", "/x/has space.gguf", "/x/" + "a" * 65 + ".gguf", "/x/deadbeef.gguf",
                "/x/prefixmesh.gguf"):
        assert m.model_name_from_path(bad, fp) == m.fallback_name(fp)
    assert m.valid_model_name(m.fallback_name(fp))


@settings(max_examples=300, deadline=None)
@given(local=st.none() | st.tuples(fps, names), peers=announcements)
def test_catalog_counts_every_valid_announcement_once(local, peers):
    entries = m.catalog(local, peers)
    assert len(entries) <= m.MAX_MODELS_LISTED
    assert len({e.fingerprint for e in entries}) == len(entries)
    valid = [(fp, n) for fp, n in peers if m.valid_model_name(n)]
    for e in entries:
        assert m.valid_model_name(e.name) or e.local
        own = 1 if e.local else 0
        assert e.nodes == own + sum(1 for fp, _ in valid if fp == e.fingerprint)
        if not e.local:  # a name some peer of that model claimed
            assert any(fp == e.fingerprint and n == e.name for fp, n in valid)
    if local is not None:
        assert entries[0].local and entries[0].fingerprint == local[0]
        assert entries[0].name == local[1]
        assert sum(e.local for e in entries) == 1
    else:
        assert not any(e.local for e in entries)
    rest = [e for e in entries if not e.local]
    assert [e.nodes for e in rest] == sorted((e.nodes for e in rest), reverse=True)


@settings(max_examples=300, deadline=None)
@given(local=st.tuples(fps, names), peers=announcements, query=st.text(max_size=80))
def test_resolve_finds_only_what_the_query_names(local, peers, query):
    entries = m.catalog(local, peers)
    got = m.resolve(query, entries)
    if got is None:
        return
    assert got in entries
    assert (query == m.LOCAL_ALIAS and got.local) or got.name == query or \
        got.fp_hex.startswith(query.lower())


@settings(max_examples=200, deadline=None)
@given(local=st.tuples(fps, names), peers=announcements)
def test_every_listed_model_resolves_by_fingerprint_and_alias(local, peers):
    entries = m.catalog(local, peers)
    for e in entries:
        assert m.resolve(e.fp_hex, entries) == e
        assert m.resolve(e.fp_hex.upper(), entries) == e
    assert m.resolve(m.LOCAL_ALIAS, entries) == entries[0]
    # a name shared by several fingerprints goes to the local model, else the largest
    for e in entries:
        got = m.resolve(e.name, entries)
        assert got is not None and got.name == e.name
        if any(x.local and x.name == e.name for x in entries):
            assert got.local
        else:
            assert got.nodes == max(x.nodes for x in entries if x.name == e.name)


def test_name_collision_prefers_local_then_majority():
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    entries = m.catalog((a, "tiny"), [(b, "tiny"), (b, "tiny"), (c, "big")])
    assert m.resolve("tiny", entries).fingerprint == a
    assert m.resolve("big", entries).fingerprint == c
    entries = m.catalog(None, [(b, "tiny"), (c, "tiny"), (c, "tiny")])
    assert m.resolve("tiny", entries).fingerprint == c
    assert m.resolve(m.LOCAL_ALIAS, entries) is None
    assert m.resolve(b.hex()[:8], entries).fingerprint == b
    assert m.resolve("6", entries) is None  # too short a prefix
    assert m.resolve("nothing", entries) is None


def test_catalog_is_bounded_under_a_flood():
    peers = [(i.to_bytes(16, "big"), f"m{i}") for i in range(10_000)]
    entries = m.catalog((b"x" * 16, "own"), peers)
    assert len(entries) == m.MAX_MODELS_LISTED and entries[0].local


# --- wire -----------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(model=st.just(b"") | fps, name=names)
def test_model_fields_round_trip(model, name):
    req = w.Request(id=b"i", ns=b"n", messages=(w.Message("user", "hi"),), model=model)
    assert w.decode_body(w.encode_frame(req)[4:]) == req
    pong = w.Pong(1, model=model, model_name=name if model else "")
    assert w.decode_body(w.encode_frame(pong)[4:]) == pong
    info = w.PeerInfo(b"p", (), True, True, 1.0, 0, 0, 0, -1.0, model=model)
    entries = (m.ModelEntry(model, name, 3, True),) if model else ()
    reply = w.PeersReply(b"me", b"fp", (), (info,), {}, models=entries)
    assert w.decode_body(w.encode_frame(reply)[4:]) == reply


def test_model_fields_refuse_bad_input():
    import cbor2

    def body(obj):
        return cbor2.dumps(obj, canonical=True)

    base = w._to_obj(w.Request(id=b"i", ns=b"n", messages=(w.Message("user", "hi"),)))
    for bad in (b"", b"x" * (m.MAX_MODEL_FP_BYTES + 1), "text"):
        with pytest.raises(w.InvalidField):
            w.decode_body(body({**base, "mo": bad}))
    for bad in ([b"fp"], [b"fp", "has space"], [b"fp", "a" * 65], [b"", "ok"], [b"fp", 3]):
        with pytest.raises(w.InvalidField):
            w.decode_body(body({"t": "pong", "n": 1, "q": 0, "a": 0, "mo": bad}))
    reply = w._to_obj(w.PeersReply(b"me", b"fp", (), (), {}))
    for bad in ([], [[b"fp", "ok", 0, True]], [[b"fp", "ok", 1]],
                [[b"fp", "ok", 1, True], [b"fp", "ok2", 1, False]]):
        with pytest.raises(w.InvalidField):
            w.decode_body(body({**reply, "mm": bad}))
    assert "unknown_model" in w.ERROR_CODES


def test_largest_peers_reply_with_models_fits_the_item_cap():
    info = w.PeerInfo(b"p" * 38, tuple(f"/ip4/1.2.3.4/tcp/{i}" for i in range(w.MAX_ADDRS)),
                      True, True, 1.0, 0, 0, 0, -1.0, tuple("s" * 8 for _ in range(8)),
                      model=b"f" * 16)
    entries = tuple(m.ModelEntry(i.to_bytes(16, "big"), f"model-{i}", 1)
                    for i in range(m.MAX_MODELS_LISTED))
    reply = w.PeersReply(b"me", b"fp", (), (info,) * w.MAX_PEERS_LISTED,
                         {f"k{i}": i for i in range(256)}, models=entries)
    frame = w.encode_frame(reply)
    assert w.decode_body(frame[4:]) == reply


@given(st.binary(min_size=8, max_size=8), st.text(max_size=600),
       st.lists(st.binary(min_size=1, max_size=8), min_size=2, max_size=6, unique=True))
def test_relay_affinity_is_stable_and_a_leaving_peer_moves_only_its_own_heads(ns, head, peers):
    from prefixmesh.overlay.core.models import AFFINITY_HEAD_CHARS, relay_affinity

    def first(ps):
        return min(ps, key=lambda p: relay_affinity(ns, head, p))

    chosen = first(peers)
    assert first(list(reversed(peers))) == chosen  # order of the peer list is irrelevant
    # only the head counts: a question after a long shared prompt does not move the choice
    long_head = ((head or "x") * AFFINITY_HEAD_CHARS)[:AFFINITY_HEAD_CHARS]
    assert min(peers, key=lambda p: relay_affinity(ns, long_head, p)) == min(
        peers, key=lambda p: relay_affinity(ns, long_head + "and the question?", p))
    other = next(p for p in peers if p != chosen)
    assert first([p for p in peers if p != other]) == chosen  # another peer left: no move
