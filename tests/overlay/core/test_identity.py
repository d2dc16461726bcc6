"""Tests for overlay/core/identity.py: keys, key files, libp2p-compatible peer ids."""

from __future__ import annotations

import json
import os
import stat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.overlay import keyfile
from prefixmesh.overlay.core.identity import (
    MAX_KEY_FILE_BYTES,
    Identity,
    IdentityError,
    InsecureKeyFile,
    InvalidKey,
    InvalidPeerId,
    KeyFileExists,
    KeyFileNotFound,
    MalformedKeyFile,
    OversizeKeyFile,
    UnsupportedKeyType,
    b58decode,
    b58encode,
    peer_id_from_b58,
    peer_id_from_public_key,
    peer_id_to_b58,
    public_key_from_peer_id,
    verify_signature,
)
from prefixmesh.overlay.keyfile import load_identity, save_identity

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


# --- key files ------------------------------------------------------------------------------


def test_save_load_round_trip(tmp_path):
    me = Identity.generate()
    path = tmp_path / "sub" / "dir" / "identity.key"
    save_identity(me, path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path.parent.parent).st_mode) == 0o700
    loaded = load_identity(path)
    assert loaded == me and loaded.seed_bytes() == me.seed_bytes()
    doc = json.loads(path.read_text())
    assert doc["peer_id"] == me.peer_id_b58 and doc["key_type"] == "ed25519"
    # no temporary files left behind
    assert sorted(p.name for p in path.parent.iterdir()) == ["identity.key"]


def test_save_refuses_overwrite_unless_asked(tmp_path):
    path = tmp_path / "id.key"
    first, second = Identity.generate(), Identity.generate()
    save_identity(first, path)
    with pytest.raises(KeyFileExists, match=str(path)):
        save_identity(second, path)
    assert load_identity(path) == first
    save_identity(second, path, overwrite=True)
    assert load_identity(path) == second
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["id.key"]


def test_save_under_permissive_umask_still_0600(tmp_path):
    old = os.umask(0)
    try:
        save_identity(Identity.generate(), tmp_path / "new" / "id.key")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "new" / "id.key").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "new").st_mode) == 0o700


def test_load_missing(tmp_path):
    with pytest.raises(KeyFileNotFound, match="not found"):
        load_identity(tmp_path / "nope.key")


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644, 0o610])
def test_load_refuses_group_or_world_access(tmp_path, mode):
    path = tmp_path / "id.key"
    save_identity(Identity.generate(), path)
    os.chmod(path, mode)
    with pytest.raises(InsecureKeyFile) as info:
        load_identity(path)
    assert f"chmod 600 {path}" in str(info.value)


def test_load_refuses_directory_and_symlink(tmp_path):
    d = tmp_path / "dir.key"
    d.mkdir(mode=0o700)
    with pytest.raises(InsecureKeyFile):
        load_identity(d)
    real = tmp_path / "real.key"
    save_identity(Identity.generate(), real)
    link = tmp_path / "link.key"
    link.symlink_to(real)
    with pytest.raises(InsecureKeyFile):
        load_identity(link)


def _write_private(path, content: bytes):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(content)
    os.chmod(path, 0o600)


def test_load_refuses_oversize(tmp_path):
    path = tmp_path / "big.key"
    _write_private(path, b" " * (MAX_KEY_FILE_BYTES + 1))
    with pytest.raises(OversizeKeyFile, match=str(path)):
        load_identity(path)


def _valid_doc():
    me = Identity.generate()
    return me, json.loads(keyfile._encode_key_file(me))


@pytest.mark.parametrize(
    "mutate,error,fragment",
    [
        (lambda d: b"", MalformedKeyFile, "JSON"),
        (lambda d: b"\xff\xfe garbage", MalformedKeyFile, "JSON"),
        (lambda d: json.dumps(d).encode()[:40], MalformedKeyFile, "JSON"),  # truncated
        (lambda d: b"[1, 2]", MalformedKeyFile, "object"),
        (lambda d: json.dumps({**d, "type": "ssh"}).encode(), UnsupportedKeyType, "type"),
        (lambda d: json.dumps({**d, "version": 2}).encode(), UnsupportedKeyType, "version"),
        (lambda d: json.dumps({**d, "version": 1.0}).encode(), UnsupportedKeyType, "version"),
        (lambda d: json.dumps({**d, "version": True}).encode(), UnsupportedKeyType, "version"),
        (lambda d: b"[" * 10_000, MalformedKeyFile, "nested too deeply"),
        (lambda d: json.dumps({**d, "key_type": "rsa"}).encode(), UnsupportedKeyType, "rsa"),
        (
            lambda d: json.dumps({k: v for k, v in d.items() if k != "seed"}).encode(),
            MalformedKeyFile,
            "seed",
        ),
        (lambda d: json.dumps({**d, "seed": 7}).encode(), MalformedKeyFile, "seed"),
        (lambda d: json.dumps({**d, "seed": "!!notbase64!!"}).encode(), MalformedKeyFile, "base64"),
        (
            lambda d: json.dumps({**d, "seed": d["seed"][:-8]}).encode(),
            MalformedKeyFile,
            "truncated",
        ),
        (
            lambda d: json.dumps({**d, "peer_id": "12D3KooWother"}).encode(),
            MalformedKeyFile,
            "does not match",
        ),
    ],
)
def test_load_refuses_malformed(tmp_path, mutate, error, fragment):
    _, doc = _valid_doc()
    path = tmp_path / "id.key"
    _write_private(path, mutate(doc))
    with pytest.raises(error, match=fragment) as info:
        load_identity(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, IdentityError)


def test_load_seed_only_file_without_peer_id_is_accepted(tmp_path):
    me, doc = _valid_doc()
    del doc["peer_id"]
    path = tmp_path / "id.key"
    _write_private(path, json.dumps(doc).encode())
    assert load_identity(path) == me
