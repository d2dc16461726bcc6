"""Tests for overlay/core/identity.py: keys, libp2p-compatible peer ids. (Key files, the IO
half in overlay/keyfile.py, are tests/overlay/test_keyfile.py.)"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.overlay.core.identity import (
    Identity,
    InvalidKey,
    InvalidPeerId,
    b58decode,
    b58encode,
    peer_id_from_b58,
    peer_id_from_public_key,
    peer_id_to_b58,
    public_key_from_peer_id,
    verify_signature,
)

seeds = st.binary(min_size=32, max_size=32)


# --- libp2p cross-checks ------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(seed=seeds)
def test_peer_id_matches_libp2p(seed):
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID

    kp = create_new_key_pair(seed)
    lib_id = ID.from_pubkey(kp.public_key)
    me = Identity.from_seed(seed)
    assert me.peer_id == lib_id.to_bytes()
    assert me.peer_id_b58 == lib_id.to_base58()
    assert me.public_bytes == kp.public_key.to_bytes()
    assert me.seed_bytes() == seed
    # libp2p can pull our key back out of the id, and verifies our signatures
    assert lib_id.extract_public_key().to_bytes() == me.public_bytes
    msg = b"hello " + seed
    assert kp.public_key.verify(msg, me.sign(msg))
    assert me.sign(msg) == kp.private_key.sign(msg)
    # and libp2p's text form parses back
    assert peer_id_from_b58(lib_id.to_base58()) == me.peer_id
    assert ID.from_base58(me.peer_id_b58).to_bytes() == me.peer_id


def test_peer_id_text_starts_like_libp2p_ed25519_ids():
    me = Identity.generate()
    assert me.peer_id_b58.startswith("12D3KooW")
    assert len(me.peer_id) == 38


# --- base58 ---------------------------------------------------------------------------


@given(st.binary(max_size=64))
def test_b58_round_trip(data):
    assert b58decode(b58encode(data)) == data


def test_b58_known_vectors():
    # vectors from the base58 IETF draft
    assert b58encode(b"Hello World!") == "2NEpo7TZRRrLZSi2U"
    assert b58encode(b"\x00\x00\x28\x7f\xb4\xcd") == "11233QC4"
    assert b58encode(b"") == ""
    with pytest.raises(ValueError):
        b58decode("0OIl")


# --- peer id helpers ------------------------------------------------------------------------


def test_public_key_round_trip_and_rejections():
    me = Identity.generate()
    assert public_key_from_peer_id(me.peer_id) == me.public_bytes
    assert peer_id_from_public_key(me.public_bytes) == me.peer_id
    with pytest.raises(InvalidKey):
        peer_id_from_public_key(b"\x01" * 31)
    with pytest.raises(InvalidPeerId):
        public_key_from_peer_id(me.peer_id[:-1])
    # a sha2-256 multihash id (e.g. RSA) does not embed a key
    with pytest.raises(InvalidPeerId):
        public_key_from_peer_id(b"\x12\x20" + b"\x00" * 32)
    with pytest.raises(InvalidPeerId):
        peer_id_from_b58("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")
    with pytest.raises(InvalidPeerId):
        peer_id_from_b58("12D3KooW0")  # '0' is not base58
    with pytest.raises(InvalidPeerId):
        peer_id_from_b58("")
    with pytest.raises(InvalidPeerId):
        peer_id_to_b58(b"junk")
    assert peer_id_from_b58(peer_id_to_b58(me.peer_id)) == me.peer_id


def test_verify_signature():
    me, other = Identity.generate(), Identity.generate()
    sig = me.sign(b"data")
    assert len(sig) == 64
    assert verify_signature(me.peer_id, b"data", sig)
    assert me.verify(b"data", sig)
    assert not verify_signature(me.peer_id, b"datA", sig)
    assert not verify_signature(other.peer_id, b"data", sig)
    assert not verify_signature(me.peer_id, b"data", sig[:-1])
    assert not verify_signature(b"not a peer id", b"data", sig)
    bad = bytearray(sig)
    bad[0] ^= 1
    assert not verify_signature(me.peer_id, b"data", bytes(bad))


def test_from_seed_rejects_wrong_length():
    with pytest.raises(InvalidKey):
        Identity.from_seed(b"\x00" * 31)


def test_identity_equality_and_repr_hide_key():
    seed = bytes(range(32))
    a, b = Identity.from_seed(seed), Identity.from_seed(seed)
    assert a == b and hash(a) == hash(b)
    assert a != Identity.generate()
    assert seed.hex() not in repr(a) and a.peer_id_b58 in repr(a)
