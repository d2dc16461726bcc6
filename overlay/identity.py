"""Node identity: Ed25519 key pairs, key files, and libp2p-compatible peer ids.

Peer ids
--------
A peer id in pure code is ``bytes``: exactly what py-libp2p 0.8.1's
``ID.from_pubkey(pk).to_bytes()`` returns for an Ed25519 public key. libp2p serialises
the key as the protobuf ``PublicKey {Type = Ed25519 (1), Data = <32 bytes>}``
(``08 01 12 20 || pub``, 36 bytes); keys of at most 42 serialised bytes are wrapped in
an *identity* multihash (code ``0x00``, length ``0x24``), so the peer id is

    00 24 08 01 12 20 || pub32          (38 bytes)

and embeds the public key: a signature can be checked against a peer id with no lookup
(:func:`verify_signature`). The text form is base58btc (Bitcoin alphabet), which for
these ids always starts with ``12D3KooW``.

Key file format
---------------
One line of JSON (UTF-8), written atomically with mode 0600; parent directories that have
to be created are created with mode 0700::

    {"type": "prefixmesh-identity", "version": 1, "key_type": "ed25519",
     "seed": "<base64 of the 32-byte private seed>", "peer_id": "<base58 peer id>"}

``peer_id`` is redundant and checked on load: it catches a corrupted or hand-edited
seed. The file must be a regular file of at most :data:`MAX_KEY_FILE_BYTES` bytes and
must grant group and others no access at all (mode 0600 or stricter); :func:`load_identity` refuses it
otherwise, with an :class:`IdentityError` subclass naming the path and the problem.

Pure code: imports ``cryptography`` and :mod:`.privatefile` only (no trio, libp2p or llama).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from .privatefile import (
    InsecureFileMode,
    NotARegularFile,
    OversizeFile,
    PrivateFileNotFound,
    PrivateFileUnreadable,
    read_private_file,
)

__all__ = [
    "ED25519_PUBLIC_KEY_BYTES",
    "ED25519_SEED_BYTES",
    "ED25519_SIGNATURE_BYTES",
    "PEER_ID_PREFIX",
    "PEER_ID_BYTES",
    "MAX_KEY_FILE_BYTES",
    "KEY_FILE_TYPE",
    "KEY_FILE_VERSION",
    "Identity",
    "IdentityError",
    "InvalidKey",
    "InvalidPeerId",
    "KeyFileNotFound",
    "KeyFileExists",
    "InsecureKeyFile",
    "OversizeKeyFile",
    "MalformedKeyFile",
    "UnsupportedKeyType",
    "save_identity",
    "load_identity",
    "peer_id_from_public_key",
    "public_key_from_peer_id",
    "verify_signature",
    "verify_with_public_key",
    "peer_id_to_b58",
    "peer_id_from_b58",
    "b58encode",
    "b58decode",
]

ED25519_PUBLIC_KEY_BYTES = 32
ED25519_SEED_BYTES = 32
ED25519_SIGNATURE_BYTES = 64
# identity multihash (code 0x00, length 36) of protobuf PublicKey{Type=1 (Ed25519), Data=32 bytes}
PEER_ID_PREFIX = b"\x00\x24\x08\x01\x12\x20"
PEER_ID_BYTES = len(PEER_ID_PREFIX) + ED25519_PUBLIC_KEY_BYTES  # 38
# A real key file is ~150 bytes; the limit only bounds what we read from a wrong path.
MAX_KEY_FILE_BYTES = 16 * 1024
KEY_FILE_TYPE = "prefixmesh-identity"
KEY_FILE_VERSION = 1
_KEY_TYPE_ED25519 = "ed25519"
# The longest base58 text we accept for a peer id; 38 bytes encode to at most 52 chars.
_MAX_B58_PEER_ID_CHARS = 64


# --- errors -----------------------------------------------------------------------------


class IdentityError(ValueError):
    """Base class of every identity, key-file and peer-id error."""


class InvalidKey(IdentityError):
    """Key material of the wrong length or shape."""


class InvalidPeerId(IdentityError):
    """Bytes or text that are not an Ed25519 identity-multihash peer id."""


class KeyFileNotFound(IdentityError):
    """The key file does not exist."""


class KeyFileExists(IdentityError):
    """Refusing to overwrite an existing key file (pass ``overwrite=True``)."""


class InsecureKeyFile(IdentityError):
    """The key file is accessible to group or others, or is not a regular file."""


class OversizeKeyFile(IdentityError):
    """The key file is larger than :data:`MAX_KEY_FILE_BYTES`."""


class MalformedKeyFile(IdentityError):
    """The key file's content does not parse, is truncated, or is inconsistent."""


class UnsupportedKeyType(MalformedKeyFile):
    """The key file holds a key type or format version this code does not know."""


# --- base58btc --------------------------------------------------------------------------

_B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {c: i for i, c in enumerate(_B58_ALPHABET)}


def b58encode(data: bytes) -> str:
    """Base58btc (Bitcoin alphabet); each leading zero byte becomes a leading '1'."""
    n_zeros = len(data) - len(data.lstrip(b"\x00"))
    value = int.from_bytes(data, "big")
    digits = []
    while value:
        value, rem = divmod(value, 58)
        digits.append(_B58_ALPHABET[rem])
    return "1" * n_zeros + "".join(reversed(digits))


def b58decode(text: str) -> bytes:
    """Inverse of :func:`b58encode`; raises ``ValueError`` on a character outside the alphabet."""
    value = 0
    for c in text:
        digit = _B58_INDEX.get(c)
        if digit is None:
            raise ValueError(f"invalid base58 character {c!r}")
        value = value * 58 + digit
    n_zeros = len(text) - len(text.lstrip("1"))
    body = value.to_bytes((value.bit_length() + 7) // 8, "big") if value else b""
    return b"\x00" * n_zeros + body


# --- peer ids ---------------------------------------------------------------------------


def peer_id_from_public_key(pub32: bytes) -> bytes:
    """The libp2p peer id bytes (identity multihash) of a raw 32-byte Ed25519 public key."""
    if not isinstance(pub32, bytes | bytearray) or len(pub32) != ED25519_PUBLIC_KEY_BYTES:
        raise InvalidKey(
            f"an Ed25519 public key is {ED25519_PUBLIC_KEY_BYTES} bytes, got "
            f"{len(pub32) if isinstance(pub32, bytes | bytearray) else type(pub32).__name__}"
        )
    return PEER_ID_PREFIX + bytes(pub32)


def public_key_from_peer_id(peer_id: bytes) -> bytes:
    """The raw 32-byte Ed25519 public key embedded in a peer id.

    Raises :class:`InvalidPeerId` for anything but an Ed25519 identity-multihash id (e.g.
    a sha256-multihash id of an RSA key, which does not embed its key).
    """
    if not isinstance(peer_id, bytes | bytearray):
        raise InvalidPeerId(f"a peer id is bytes, got {type(peer_id).__name__}")
    if len(peer_id) != PEER_ID_BYTES or not peer_id.startswith(PEER_ID_PREFIX):
        raise InvalidPeerId(
            f"not an Ed25519 identity-multihash peer id ({len(peer_id)} bytes, "
            f"prefix {bytes(peer_id[:6]).hex()}; expected {PEER_ID_BYTES} bytes with prefix "
            f"{PEER_ID_PREFIX.hex()})"
        )
    return bytes(peer_id[len(PEER_ID_PREFIX) :])


def peer_id_to_b58(peer_id: bytes) -> str:
    """Base58btc text form of a peer id (``12D3KooW...``); validates the bytes first."""
    public_key_from_peer_id(peer_id)
    return b58encode(bytes(peer_id))


def peer_id_from_b58(text: str) -> bytes:
    """Peer id bytes from the base58btc text form; raises :class:`InvalidPeerId`."""
    if not isinstance(text, str):
        raise InvalidPeerId(f"a peer id text is str, got {type(text).__name__}")
    if not text or len(text) > _MAX_B58_PEER_ID_CHARS:
        raise InvalidPeerId(f"peer id text of {len(text)} characters is not a valid length")
    try:
        raw = b58decode(text)
    except ValueError as exc:
        raise InvalidPeerId(f"peer id {text!r}: {exc}") from None
    public_key_from_peer_id(raw)
    return raw


def verify_with_public_key(pub32: bytes, data: bytes, sig: bytes) -> bool:
    """True iff ``sig`` is a valid Ed25519 signature of ``data`` by raw public key ``pub32``."""
    if len(pub32) != ED25519_PUBLIC_KEY_BYTES or len(sig) != ED25519_SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(bytes(pub32)).verify(bytes(sig), bytes(data))
    except (InvalidSignature, ValueError):
        # ValueError: a 32-byte string that is not a valid curve point
        return False
    return True


def verify_signature(peer_id: bytes, data: bytes, sig: bytes) -> bool:
    """True iff ``sig`` is a valid signature of ``data`` by the key embedded in ``peer_id``.

    Returns False (never raises) for a peer id that does not embed an Ed25519 key: such a
    peer cannot have produced a signature we can check.
    """
    try:
        pub = public_key_from_peer_id(peer_id)
    except IdentityError:
        return False
    return verify_with_public_key(pub, data, sig)


# --- identity ---------------------------------------------------------------------------


class Identity:
    """An Ed25519 key pair and the peer id derived from it."""

    __slots__ = ("private_key", "public_bytes", "peer_id", "peer_id_b58")

    def __init__(self, private_key: Ed25519PrivateKey):
        if not isinstance(private_key, Ed25519PrivateKey):
            raise InvalidKey(f"expected an Ed25519PrivateKey, got {type(private_key).__name__}")
        self.private_key = private_key
        self.public_bytes: bytes = private_key.public_key().public_bytes_raw()
        self.peer_id: bytes = peer_id_from_public_key(self.public_bytes)
        self.peer_id_b58: str = b58encode(self.peer_id)

    @classmethod
    def generate(cls) -> Identity:
        """A fresh random key pair (OS randomness)."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed32: bytes) -> Identity:
        """The key pair of a 32-byte private seed (RFC 8032 private key)."""
        if not isinstance(seed32, bytes | bytearray) or len(seed32) != ED25519_SEED_BYTES:
            raise InvalidKey(f"an Ed25519 seed is {ED25519_SEED_BYTES} bytes")
        return cls(Ed25519PrivateKey.from_private_bytes(bytes(seed32)))

    def seed_bytes(self) -> bytes:
        """The 32-byte private seed (what libp2p's ``create_new_key_pair(seed)`` takes)."""
        return self.private_key.private_bytes_raw()

    def sign(self, data: bytes) -> bytes:
        """64-byte Ed25519 signature of ``data``."""
        return self.private_key.sign(bytes(data))

    def verify(self, data: bytes, sig: bytes) -> bool:
        return verify_with_public_key(self.public_bytes, data, sig)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Identity) and other.public_bytes == self.public_bytes

    def __hash__(self) -> int:
        return hash(self.public_bytes)

    def __repr__(self) -> str:  # never shows the private key
        return f"Identity({self.peer_id_b58})"


# --- key files --------------------------------------------------------------------------


def _encode_key_file(identity: Identity) -> bytes:
    doc = {
        "type": KEY_FILE_TYPE,
        "version": KEY_FILE_VERSION,
        "key_type": _KEY_TYPE_ED25519,
        "seed": base64.b64encode(identity.seed_bytes()).decode("ascii"),
        "peer_id": identity.peer_id_b58,
    }
    return (json.dumps(doc, separators=(", ", ": ")) + "\n").encode("utf-8")


def save_identity(
    identity: Identity, path: str | os.PathLike[str], *, overwrite: bool = False
) -> None:
    """Write ``identity`` to ``path`` atomically with mode 0600.

    The content goes to a temporary file in the same directory (created 0600, so the
    seed is never readable by others even briefly), is fsynced, then moved into place:
    a crash leaves either no file or a complete one. Without ``overwrite`` an existing
    file raises :class:`KeyFileExists` (checked atomically: ``link`` fails if it exists).
    Missing parent directories are created with mode 0700.
    """
    path = Path(path)
    parent = path.parent
    missing = []
    ancestor = parent
    while not ancestor.exists():
        missing.append(ancestor)
        ancestor = ancestor.parent
    for directory in reversed(missing):  # every directory we create is private
        directory.mkdir(mode=0o700, exist_ok=True)
        os.chmod(directory, 0o700)  # mkdir's mode is filtered by the umask
    if not overwrite and path.exists():
        raise KeyFileExists(f"{path}: key file already exists (refusing to overwrite)")
    content = _encode_key_file(identity)
    tmp = parent / f".{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, content)
            os.fsync(fd)
        finally:
            os.close(fd)
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise KeyFileExists(
                    f"{path}: key file already exists (refusing to overwrite)"
                ) from None
            os.unlink(tmp)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:  # make the rename durable
        dir_fd = os.open(parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def load_identity(path: str | os.PathLike[str]) -> Identity:
    """Read a key file written by :func:`save_identity`.

    Raises (all :class:`IdentityError`): :class:`KeyFileNotFound`; :class:`InsecureKeyFile`
    if it is not a regular file or group/others have any access (fix: ``chmod 600 PATH``);
    :class:`OversizeKeyFile`; :class:`MalformedKeyFile` for bad JSON, missing or
    mistyped fields, a truncated seed, or a peer id that does not match the seed;
    :class:`UnsupportedKeyType` for an unknown file type, version or key type.
    """
    path = Path(path)
    try:
        content = read_private_file(path, MAX_KEY_FILE_BYTES)
    except PrivateFileNotFound:
        raise KeyFileNotFound(f"{path}: key file not found") from None
    except PrivateFileUnreadable as exc:
        raise InsecureKeyFile(f"{path}: cannot open key file: {exc.strerror}") from None
    except NotARegularFile:
        raise InsecureKeyFile(f"{path}: key file is not a regular file") from None
    except InsecureFileMode as exc:
        raise InsecureKeyFile(
            f"{path}: key file is accessible by group or others "
            f"(mode {exc.mode:04o}); fix with: chmod 600 {path}"
        ) from None
    except OversizeFile as exc:
        if exc.size is not None:
            raise OversizeKeyFile(
                f"{path}: key file is {exc.size} bytes, more than the "
                f"{MAX_KEY_FILE_BYTES}-byte limit; is this the right file?"
            ) from None
        raise OversizeKeyFile(
            f"{path}: key file exceeds the {MAX_KEY_FILE_BYTES}-byte limit"
        ) from None
    return _parse_key_file(content, path)


def _parse_key_file(content: bytes, path: Path) -> Identity:
    try:
        doc = json.loads(content.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise MalformedKeyFile(f"{path}: key file is not valid JSON ({exc})") from None
    except RecursionError:  # json recurses per nesting level; a key file is flat
        raise MalformedKeyFile(f"{path}: key file is not valid JSON (nested too deeply)") from None
    if not isinstance(doc, dict):
        raise MalformedKeyFile(f"{path}: key file must hold a JSON object")
    if doc.get("type") != KEY_FILE_TYPE:
        raise UnsupportedKeyType(
            f"{path}: not a prefixmesh identity file (type {doc.get('type')!r}, "
            f"expected {KEY_FILE_TYPE!r})"
        )
    version = doc.get("version")
    # 1.0 == 1 and True == 1 in Python: insist on the JSON integer itself
    if type(version) is not int or version != KEY_FILE_VERSION:
        raise UnsupportedKeyType(
            f"{path}: unsupported key file version {doc.get('version')!r} "
            f"(this code reads version {KEY_FILE_VERSION})"
        )
    if doc.get("key_type") != _KEY_TYPE_ED25519:
        raise UnsupportedKeyType(
            f"{path}: unsupported key type {doc.get('key_type')!r} (only 'ed25519')"
        )
    seed_text = doc.get("seed")
    if not isinstance(seed_text, str):
        raise MalformedKeyFile(f"{path}: key file lacks a 'seed' string")
    try:
        seed = base64.b64decode(seed_text, validate=True)
    except (binascii.Error, ValueError):
        raise MalformedKeyFile(f"{path}: 'seed' is not valid base64") from None
    if len(seed) != ED25519_SEED_BYTES:
        raise MalformedKeyFile(
            f"{path}: 'seed' is {len(seed)} bytes, expected {ED25519_SEED_BYTES} (truncated?)"
        )
    identity = Identity.from_seed(seed)
    recorded = doc.get("peer_id")
    if recorded is not None and recorded != identity.peer_id_b58:
        raise MalformedKeyFile(
            f"{path}: recorded peer_id {recorded!r} does not match the seed's "
            f"{identity.peer_id_b58} (corrupted file?)"
        )
    return identity
