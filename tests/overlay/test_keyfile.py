"""overlay/keyfile.py: writing and reading an Identity's key file (the format is in
overlay/core/identity.py): the round trip, modes 0600/0700 under any umask, no overwrite
unless asked, and every refusal (missing, group/world access, directory, symlink, oversize,
malformed) a named error carrying the path. (Moved from tests/overlay/core/test_identity.py.)"""

from __future__ import annotations

import json
import os
import stat

import pytest

from prefixmesh.overlay import keyfile
from prefixmesh.overlay.core.identity import (
    MAX_KEY_FILE_BYTES,
    Identity,
    IdentityError,
    InsecureKeyFile,
    KeyFileExists,
    KeyFileNotFound,
    MalformedKeyFile,
    OversizeKeyFile,
    UnsupportedKeyType,
)
from prefixmesh.overlay.keyfile import load_identity, save_identity


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
