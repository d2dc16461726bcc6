"""Node identity: Ed25519 key pairs, signatures and libp2p-compatible peer ids.

Key files (reading and writing them) are IO and live in ``overlay/keyfile.py``; the
format is documented here because the constants that define it are here.

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
must grant group and others no access at all (mode 0600 or stricter); ``overlay/keyfile.py`` refuses it
otherwise, with an :class:`IdentityError` subclass naming the path and the problem.

Pure code: imports ``cryptography`` only (no IO, no trio, libp2p or llama).
"""

from __future__ import annotations

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
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
