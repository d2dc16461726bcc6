"""Many models in one mesh: model names, the mesh's model catalog, naming a model (pure).

A model is known by its **fingerprint** (the GGUF header hash, 16 bytes: what KV states,
digests and namespace keys are bound to) and a **name** for people (the model file's
stem, e.g. ``SmolLM2-135M-Instruct.Q4_1``). Nodes announce ``(fingerprint, name)`` in
their first PONG on each heartbeat stream; a name is a peer's *claim* (untrusted), a
fingerprint is exact.

:func:`catalog` turns what the up peers announced into the models the mesh can serve now,
with how many nodes serve each; :func:`resolve` maps what a request names (a name, the
alias :data:`LOCAL_ALIAS`, a fingerprint in hex or a unique hex prefix of at least
:data:`MIN_FP_PREFIX_HEX` digits) to one catalog entry. Two fingerprints may claim the
same name: the entry node's own model wins, else the one with the most nodes (then the
smaller fingerprint); a fingerprint always names exactly one.

Bounds: names are at most :data:`MAX_MODEL_NAME_CHARS` characters of
:data:`NAME_CHARS`; fingerprints 1..:data:`MAX_MODEL_FP_BYTES` bytes; a catalog lists at
most :data:`MAX_MODELS_LISTED` models (the local one always among them).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "AFFINITY_HEAD_CHARS",
    "LOCAL_ALIAS",
    "MAX_MODEL_FP_BYTES",
    "MAX_MODEL_NAME_CHARS",
    "MAX_MODELS_LISTED",
    "MIN_FP_PREFIX_HEX",
    "NAME_CHARS",
    "ModelEntry",
    "catalog",
    "relay_affinity",
    "fallback_name",
    "model_name_from_path",
    "resolve",
    "valid_model_name",
]

MAX_MODEL_NAME_CHARS = 64
MAX_MODEL_FP_BYTES = 32
MAX_MODELS_LISTED = 64
MIN_FP_PREFIX_HEX = 8
#: the name every node accepts for its own model, whatever it is (OpenAI clients that
#: need some model name; what the gateway always offered)
LOCAL_ALIAS = "prefixmesh"
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-+:@")
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class ModelEntry:
    """One model the mesh can serve now, as one node sees it."""

    fingerprint: bytes
    name: str
    nodes: int  # up nodes serving it (this node included when it is ``local``)
    local: bool = False  # this node serves it

    @property
    def fp_hex(self) -> str:
        return self.fingerprint.hex()


def valid_model_name(name: object) -> bool:
    """A name a node may announce: 1..64 characters of :data:`NAME_CHARS`, not all hex
    digits (it would read as a fingerprint) and not the local alias."""
    return (isinstance(name, str) and 0 < len(name) <= MAX_MODEL_NAME_CHARS
            and all(c in NAME_CHARS for c in name) and name != LOCAL_ALIAS
            and not set(name.lower()) <= _HEX)


def fallback_name(fingerprint: bytes) -> str:
    """The name of a model whose file gives none that is valid."""
    return "model-" + bytes(fingerprint).hex()[:12]


def model_name_from_path(path: str | None, fingerprint: bytes) -> str:
    """A model file's stem without ``.gguf`` (``/m/SmolLM2-135M-Instruct.Q4_1.gguf`` ->
    ``SmolLM2-135M-Instruct.Q4_1``), or :func:`fallback_name` when it is not a valid name."""
    if path:
        stem = str(path).replace("\\", "/").rsplit("/", 1)[-1]
        if stem.lower().endswith(".gguf"):
            stem = stem[: -len(".gguf")]
        if valid_model_name(stem):
            return stem
    return fallback_name(fingerprint)


def _valid_fp(fp: object) -> bool:
    return isinstance(fp, bytes) and 0 < len(fp) <= MAX_MODEL_FP_BYTES


def catalog(local: tuple[bytes, str] | None,
            peers: Iterable[tuple[bytes, str]]) -> tuple[ModelEntry, ...]:
    """The models ``local`` (this node's (fingerprint, name); None for a client-only view)
    and the up ``peers`` (one (fingerprint, name) per peer) serve: one entry per
    fingerprint, the local one first, then most nodes first (then name, fingerprint);
    invalid announcements are skipped; at most :data:`MAX_MODELS_LISTED` entries.

    A fingerprint's name is the local one's, else the name most of its peers claim
    (ties: the smallest)."""
    counts: dict[bytes, int] = {}
    names: dict[bytes, dict[str, int]] = {}
    for fp, name in peers:
        if not _valid_fp(fp) or not valid_model_name(name):
            continue
        if fp not in counts and len(counts) >= 4 * MAX_MODELS_LISTED:
            continue  # bounded work for a flood of made-up models
        counts[fp] = counts.get(fp, 0) + 1
        claimed = names.setdefault(fp, {})
        if name in claimed or len(claimed) < 8:
            claimed[name] = claimed.get(name, 0) + 1
    entries: list[ModelEntry] = []
    local_fp = b""
    if local is not None and _valid_fp(local[0]):
        local_fp = local[0]
        entries.append(ModelEntry(local_fp, local[1], counts.pop(local_fp, 0) + 1, True))
        names.pop(local_fp, None)
    others = [
        ModelEntry(fp, min(names[fp].items(), key=lambda kv: (-kv[1], kv[0]))[0], n)
        for fp, n in counts.items()
    ]
    others.sort(key=lambda e: (-e.nodes, e.name, e.fingerprint))
    entries.extend(others)
    return tuple(entries[:MAX_MODELS_LISTED])


def resolve(query: str, entries: Sequence[ModelEntry]) -> ModelEntry | None:
    """The entry ``query`` names (see the module docstring), or None."""
    if not isinstance(query, str) or not query or len(query) > 2 * MAX_MODEL_FP_BYTES + 16:
        return None
    if query == LOCAL_ALIAS:
        return next((e for e in entries if e.local), None)
    q = query.lower()
    if set(q) <= _HEX:
        exact = next((e for e in entries if e.fp_hex == q), None)
        if exact is not None or len(q) < MIN_FP_PREFIX_HEX:
            return exact
        hits = [e for e in entries if e.fp_hex.startswith(q)]
        return hits[0] if len(hits) == 1 else None
    named = [e for e in entries if e.name == query]
    if not named:
        return None
    # the local model first, then most nodes (catalog order already is)
    return min(named, key=lambda e: (not e.local, -e.nodes, e.fingerprint))


# The relay of a request for another model cannot tokenize it (another tokenizer), so it
# sends requests whose prompts start alike to the same node, where their prefix is cached:
# the first characters of the prompt (a system prompt, a document) are its likely prefix.
AFFINITY_HEAD_CHARS = 512


def relay_affinity(ns: bytes, head: str, peer: bytes) -> int:
    """Rendezvous rank of ``peer`` for a prompt starting with ``head`` (lower first): the
    same prompt head picks the same peer among equally loaded ones, and a peer leaving
    moves only the heads it ranked first."""
    key = hashlib.sha256(b"%d:%s|%s|%s" % (len(ns), ns, head[:AFFINITY_HEAD_CHARS].encode(), peer))
    return int.from_bytes(key.digest()[:8], "big")
