"""Chained, namespace-keyed block hashes: the one block-hash function of prefixmesh.

A token sequence is cut into blocks of ``block_tokens`` token ids (default 16); a
trailing partial block is never hashed. Block ``i`` hashes to

    h_i = BLAKE2b-64(key=namespace_key, data=h_{i-1} || le_u32(block_i tokens))

with ``h_0`` = eight zero bytes. Because every hash covers its predecessor, ``h_i``
names the whole prefix of ``i`` blocks, so a peer index can answer "how long a prefix
does peer X hold" with set membership alone.

The namespace key is derived from the tenant secret, the namespace name and the model
fingerprint. Hashes of one tenant are therefore unlinkable to another's (and to other
models'), and a digest reveals nothing to a peer that lacks the secret.

Hashes are 64 bits: a false match is possible in principle (about 2^-64 per pair). It
can only ever cost a cache miss, because the serving node re-matches the *token ids*
against its own radix tree before reusing anything; hashes never select KV data.

Pure code: no trio, libp2p or llama imports.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence

__all__ = [
    "BLOCK_TOKENS",
    "HASH_BYTES",
    "ROOT_HASH",
    "NAMESPACE_KEY_BYTES",
    "derive_namespace_key",
    "namespace_id",
    "chain_hashes",
    "extend_chain",
    "blocks_in",
]

BLOCK_TOKENS = 16
HASH_BYTES = 8
NAMESPACE_KEY_BYTES = 32
ROOT_HASH = bytes(HASH_BYTES)

_KEY_LABEL = b"prefixmesh/namespace-key/v1\x00"
_ID_LABEL = b"prefixmesh/namespace-id/v1"
_MAX_TOKEN_ID = 0xFFFFFFFF


def derive_namespace_key(secret: bytes, namespace: str, model_fingerprint: bytes) -> bytes:
    """The 32-byte key that keys every block hash of ``namespace`` for one model.

    ``secret`` is the tenant secret (for a ``public`` namespace, a well-known value such
    as the namespace name itself: anyone may compute its hashes, by design).
    """
    if not isinstance(secret, bytes | bytearray) or not secret:
        raise ValueError("namespace secret must be non-empty bytes")
    if not namespace:
        raise ValueError("namespace name must be non-empty")
    if not model_fingerprint:
        raise ValueError("model fingerprint must be non-empty bytes")
    ns = namespace.encode("utf-8")
    msg = _KEY_LABEL + struct.pack("<H", len(ns)) + ns + bytes(model_fingerprint)
    return hmac.new(bytes(secret), msg, hashlib.sha256).digest()


def namespace_id(namespace_key: bytes) -> bytes:
    """An 8-byte public name for a namespace key, used in digests and requests.

    It is a keyed hash, so it identifies the namespace without revealing the key.
    """
    _check_key(namespace_key)
    return hashlib.blake2b(_ID_LABEL, key=namespace_key, digest_size=HASH_BYTES).digest()


def blocks_in(n_tokens: int, block_tokens: int = BLOCK_TOKENS) -> int:
    """Number of whole blocks in a sequence of ``n_tokens`` tokens."""
    if block_tokens <= 0:
        raise ValueError("block_tokens must be positive")
    return max(0, n_tokens) // block_tokens


def extend_chain(
    namespace_key: bytes,
    prev: bytes,
    tokens: Sequence[int],
    block_tokens: int = BLOCK_TOKENS,
) -> list[bytes]:
    """Hashes of the whole blocks of ``tokens``, chained after ``prev``.

    ``tokens`` must start at a block boundary; a trailing partial block is ignored.
    """
    _check_key(namespace_key)
    if len(prev) != HASH_BYTES:
        raise ValueError(f"previous hash must be {HASH_BYTES} bytes")
    n_tokens = blocks_in(len(tokens), block_tokens) * block_tokens
    try:  # all whole blocks in one pack (a trailing partial block is never read)
        packed = struct.pack(f"<{n_tokens}I", *tokens[:n_tokens])
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in [0, {_MAX_TOKEN_ID}]") from exc
    # a copy of the keyed state skips hashing the key block again for every block
    keyed = hashlib.blake2b(key=namespace_key, digest_size=HASH_BYTES).copy
    step = 4 * block_tokens
    out: list[bytes] = []
    for at in range(0, len(packed), step):
        h = keyed()
        h.update(prev)
        h.update(packed[at : at + step])
        prev = h.digest()
        out.append(prev)
    return out


def chain_hashes(
    namespace_key: bytes, tokens: Sequence[int], block_tokens: int = BLOCK_TOKENS
) -> list[bytes]:
    """Chained hashes of every whole block of ``tokens``, starting from the root."""
    return extend_chain(namespace_key, ROOT_HASH, tokens, block_tokens)


def _check_key(namespace_key: bytes) -> None:
    if not isinstance(namespace_key, bytes) or len(namespace_key) != NAMESPACE_KEY_BYTES:
        raise ValueError(f"namespace key must be {NAMESPACE_KEY_BYTES} bytes")
