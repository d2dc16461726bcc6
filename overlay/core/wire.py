"""Frame codec and stream state machine of prefixmesh's own libp2p protocols.

Protocols
---------
``/prefixmesh/infer/1.0.0`` (one request per stream)::

    requester -> REQUEST
    server    -> TOKENS* FINAL END        (success)
    server    -> TOKENS* ERROR            (failure; ERROR is terminal, also after TOKENS)

``/prefixmesh/ping/1.0.0`` (one long-lived stream per peer): PING -> PONG, repeated.

``/prefixmesh/peers/1.0.0`` (one query per stream): PEERS_QUERY -> PEERS_REPLY.

Framing
-------
Every frame is ``u32 big-endian length || body``; the body is one *canonical* CBOR map
(RFC 8949 section 4.2.1 deterministic encoding: shortest heads, sorted keys, definite
lengths) whose key ``"t"`` names the frame type. A decoder re-encodes what it decodes
and rejects a body that is not byte-identical to its canonical form, so every message
has exactly one encoding (relayed frames can be compared and hashed bytewise).

Token ids (prompt tokens, streamed token ids) travel as one CBOR byte string of u32
little-endian values, not as an array.

Limits (module constants; a frame over any of them raises a :class:`WireError`
subclass and the stream is dropped; nothing is truncated silently):

* :data:`MAX_FRAME_BYTES` (512 KiB) per frame body; the length prefix is checked before
  any body byte is buffered, so a :class:`FrameDecoder` never holds more than
  ``4 + MAX_FRAME_BYTES`` bytes.
* :data:`MAX_MESSAGES` chat messages, :data:`MAX_TEXT_CHARS` characters per message
  (and per streamed text chunk), :data:`MAX_PROMPT_CHARS` characters of raw prompt text,
  :data:`MAX_PROMPT_TOKENS` prompt token ids,
  :data:`MAX_CHUNK_TOKENS` token ids per TOKENS frame.
* :data:`MAX_HOPS` entries in a route trace, in the visited list, and as hop budget.
* :data:`MAX_CARRIED_HOLDERS` holders carried on a forwarded request (partitioned digests).
* :data:`MAX_SHORT_STRING` characters for roles, codes, reasons; :data:`MAX_ERROR_CHARS`
  for error messages; :data:`MAX_ID_BYTES` for ids and credentials.
* :data:`MAX_GRAMMAR_CHARS` characters of GBNF grammar on a request (constrained output);
  :data:`MAX_TOP_LOGPROBS` alternatives per token and :data:`MAX_LOGPROB_ENTRIES` entries
  per TOKENS frame, each token's bytes at most :data:`MAX_PIECE_BYTES`.
* :data:`MAX_CBOR_DEPTH` nesting levels; CBOR tags, indefinite lengths, undefined and
  simple values are refused before the CBOR library sees the bytes.

Pure code: imports ``cbor2`` and the pure ``cbor`` scanner only (no trio, libp2p or llama);
clocks are never read.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import cbor2

from . import cbor
from .models import MAX_MODEL_FP_BYTES, MAX_MODELS_LISTED, ModelEntry, valid_model_name

__all__ = [
    "INFER_PROTOCOL",
    "PING_PROTOCOL",
    "PEERS_PROTOCOL",
    "DIGEST_PROTOCOL",
    "LENGTH_PREFIX_BYTES",
    "MAX_FRAME_BYTES",
    "MAX_MESSAGES",
    "MAX_TEXT_CHARS",
    "MAX_PROMPT_CHARS",
    "MAX_PROMPT_TOKENS",
    "MAX_CHUNK_TOKENS",
    "MAX_HOPS",
    "MAX_SHORT_STRING",
    "MAX_ERROR_CHARS",
    "MAX_ID_BYTES",
    "MAX_CBOR_DEPTH",
    "MAX_CBOR_ITEMS",
    "MAX_PEERS_LISTED",
    "MAX_ADDRS",
    "MAX_GRAMMAR_CHARS",
    "MAX_TOP_LOGPROBS",
    "MAX_LOGPROB_ENTRIES",
    "MAX_PIECE_BYTES",
    "ERROR_CODES",
    "WireError",
    "OversizeFrame",
    "TruncatedFrame",
    "MalformedFrame",
    "NonCanonicalFrame",
    "UnknownFrameType",
    "InvalidField",
    "LimitExceeded",
    "ProtocolViolation",
    "Message",
    "Sampling",
    "Hop",
    "Request",
    "TokenLogprob",
    "Tokens",
    "Final",
    "End",
    "Error",
    "Ping",
    "Pong",
    "PeersQuery",
    "PeerInfo",
    "PeersReply",
    "Frame",
    "encode_frame",
    "decode_body",
    "FrameDecoder",
    "InferStreamState",
]

INFER_PROTOCOL = "/prefixmesh/infer/1.0.0"
PING_PROTOCOL = "/prefixmesh/ping/1.0.0"
PEERS_PROTOCOL = "/prefixmesh/peers/1.0.0"
DIGEST_PROTOCOL = "/prefixmesh/digest/1.0.0"
PARTITION_PROTOCOL = "/prefixmesh/digest-part/1.0.0"

LENGTH_PREFIX_BYTES = 4
MAX_FRAME_BYTES = 512 * 1024
MAX_MESSAGES = 256
MAX_TEXT_CHARS = 128 * 1024
MAX_PROMPT_TOKENS = 32_768
# a raw-prompt completion for another model travels as text to a node of that model (only
# it has the tokenizer); as long as a message may be, ~32k tokens of English
MAX_PROMPT_CHARS = MAX_TEXT_CHARS
MAX_CHUNK_TOKENS = 1024
MAX_HOPS = 16
MAX_SHORT_STRING = 256
MAX_ERROR_CHARS = 2048
MAX_ID_BYTES = 512
MAX_CBOR_DEPTH = 8
# CBOR items (all levels) in one frame. Token ids travel as packed bytes, so the largest
# legitimate frame (a PEERS reply of MAX_PEERS_LISTED peers with MAX_ADDRS addrs each) has
# ~30,000 items; without a cap a 512 KiB frame of one-byte items costs ~0.3 s of Python
# before the schema refuses it (remote CPU amplification). tests/overlay/core/test_wire.py checks the
# largest frames of every type stay under it.
MAX_CBOR_ITEMS = 65_536
MAX_PEERS_LISTED = 1024
MAX_ADDRS = 16
MAX_MAX_TOKENS = 32_768
MAX_SUMMARY_HASH_BYTES = 32
# the holder list a partitioned router carries on to its next hop (a home's lookup answer:
# overlay/core/partition.py bounds an answer to the same 256 holders)
MAX_CARRIED_HOLDERS = 256
# constrained output (response_format, tool calls): a llama.cpp GBNF grammar generated by
# the entry gateway, compiled by the serving node's llama.cpp (which refuses a malformed one)
MAX_GRAMMAR_CHARS = 64 * 1024
# logprobs: OpenAI's top_logprobs limit; entries per TOKENS frame keep a frame of 20
# alternatives per token well under MAX_CBOR_ITEMS (256 * (4 + 20 * 3) = 16,384 items)
MAX_TOP_LOGPROBS = 20
MAX_LOGPROB_ENTRIES = 256
MAX_PIECE_BYTES = 256
MIN_LOGPROB = -1e6
MAX_DEADLINE = 1e11  # Unix seconds (year ~5138): rejects inf and absurd values

#: Error codes an ERROR frame may carry (anything else is a malformed frame).
ERROR_CODES = frozenset(
    {
        "bad_request",  # the request violates the protocol or its limits
        "unauthorized",  # the namespace credential is missing or wrong
        "unknown_namespace",  # this node serves no such namespace
        "context_length_exceeded",  # the prompt does not fit the serving nodes' context
        "overloaded",  # queue full
        "deadline",  # the request's deadline passed before it completed
        "no_route",  # every candidate failed and local serving is impossible
        "upstream_failed",  # the next hop failed mid-stream after tokens were relayed
        "shutting_down",  # the node is stopping; retry elsewhere
        "duplicate",  # this node already handled a request with this id; retry elsewhere
        "internal",  # a bug or engine failure on the serving node
        "unknown_model",  # no node this one knows serves the requested model
    }
)


# --- errors -----------------------------------------------------------------------------


class WireError(ValueError):
    """Base class of every framing, decoding and protocol-order error."""


class OversizeFrame(WireError):
    """A length prefix announced a body larger than :data:`MAX_FRAME_BYTES`."""


class TruncatedFrame(WireError):
    """The stream ended in the middle of a frame."""


class MalformedFrame(WireError):
    """The body is not a well-formed CBOR map of the accepted subset."""


class NonCanonicalFrame(MalformedFrame):
    """The body decodes, but is not in canonical (deterministic) CBOR encoding."""


class UnknownFrameType(MalformedFrame):
    """The ``"t"`` key names no frame type of this protocol version."""


class InvalidField(MalformedFrame):
    """A field is missing, of the wrong type, out of range, or unexpected."""


class LimitExceeded(InvalidField):
    """A field exceeds one of the documented limits (messages, tokens, hops, ...)."""


class ProtocolViolation(WireError):
    """A well-formed frame arrived in a state that does not allow it."""


# --- frames -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class Sampling:
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class Hop:
    """One node's routing decision, as recorded in the route trace.

    ``ttft_ms`` is filled in by that node when the first token came back to it (from its
    own engine or from downstream), so consecutive hops' differences show what each hop
    added. ``-1.0`` means not known (yet).
    """

    peer: bytes
    action: str  # "serve" | "forward" | "fallback" (a forward that failed; see reason)
    reason: str
    next_peer: bytes = b""
    local_matched_tokens: int = 0
    est_local_s: float = -1.0
    est_peer_s: float = -1.0
    decide_ms: float = 0.0
    ttft_ms: float = -1.0


@dataclass(frozen=True)
class Request:
    id: bytes
    ns: bytes
    credential: bytes = b""
    messages: tuple[Message, ...] = ()
    tokens: tuple[int, ...] = ()  # prompt token ids; used instead of messages when non-empty
    sampling: Sampling = field(default_factory=Sampling)
    deadline: float = 0.0  # absolute, Unix seconds (the credential binds it; see node/tenants)
    hop_budget: int = 3  # further forwards allowed after the receiving node
    visited: tuple[bytes, ...] = ()  # peers that already handled this request
    trace: tuple[Hop, ...] = ()  # hops so far (entry first)
    stream: bool = True
    # partitioned digests: (peer, matched blocks) a router that is not a home of the
    # prompt's partition decided with (a home's lookup answer), carried on so the next
    # hop can decide with it too; unverified routing hints, like any lookup answer
    holders: tuple[tuple[bytes, int], ...] = ()
    # constrained output: a GBNF grammar the sampler must follow (key "gr", omitted when
    # empty); the serving node compiles it and answers ERROR bad_request if it cannot
    grammar: str = ""
    # log probabilities: -1 none (key "lp" omitted); 0..MAX_TOP_LOGPROBS: each token's
    # logprob and that many most likely alternatives, in the TOKENS frames
    logprobs: int = -1
    # the fingerprint of the model asked for (key "mo", omitted when empty: the model of
    # the node that receives it); a node of another model passes it to nodes of this one
    model: bytes = b""
    # a raw-prompt completion's text (key "pr", omitted when empty), instead of messages
    # and tokens: the first node of the request's model tokenizes it as it is (with its
    # own tokenizer, special tokens parsed, no BOS added) and sends token ids on
    prompt: str = ""


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log probability under the model (before any grammar mask) and
    the ``top`` most likely tokens at that step as (token bytes, logprob), most likely first."""

    piece: bytes
    logprob: float
    top: tuple[tuple[bytes, float], ...] = ()


@dataclass(frozen=True)
class Tokens:
    text: str
    token_ids: tuple[int, ...] = ()
    # one entry per generated token of this frame when the request asked for logprobs
    # (key "lp", omitted when empty)
    logprobs: tuple[TokenLogprob, ...] = ()
    # the serving node's count of the prompt's tokens, on its first TOKENS frame (key
    # "pt", omitted otherwise: 0 means not said here). An entry that stops reading before
    # FINAL (a stop sequence) still has the usage; for another model's request only that
    # node knows the count (it tokenized the text)
    prompt_tokens: int = 0
    # ... and how many of them came from its cache (key "ct", only with "pt"; -1: not known)
    cached_tokens: int = -1


@dataclass(frozen=True)
class Final:
    id: bytes
    entry: bytes  # the node the client talked to
    serving: bytes  # the node that ran the model
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from the serving node's cache
    completion_tokens: int
    ttft_ms: float  # at the serving node, from receipt of the request
    total_ms: float  # at the serving node
    finish_reason: str
    hops: tuple[Hop, ...]  # the whole route: entry first, serving node last
    # served by continuous batching (the engine's "throughput" mode): a greedy answer may
    # differ from a single-sequence run, so spot checks judge it leniently (key "b",
    # omitted when False)
    batched: bool = False


@dataclass(frozen=True)
class End:
    pass


@dataclass(frozen=True)
class Error:
    code: str
    message: str


@dataclass(frozen=True)
class Ping:
    nonce: int


@dataclass(frozen=True)
class Pong:
    nonce: int
    queue_depth: int = 0
    active: int = 0
    # the responder's digest summary hash (gossip.summary_hash), sent only when it changed
    # since the last PONG on this stream (b"": unchanged); lets peers skip digest
    # exchanges with nodes that already hold the same records
    summary_hash: bytes = b""
    # the responder's context length in tokens (0: not said), so an entry node refuses a
    # prompt that fits no node and forwards none to a node too small for it
    n_ctx: int = 0
    # the model the responder serves (fingerprint, name), in the first PONG of a stream
    # (key "mo", omitted otherwise: b"" / "" means not said on this PONG)
    model: bytes = b""
    model_name: str = ""


@dataclass(frozen=True)
class PeersQuery:
    pass


@dataclass(frozen=True)
class PeerInfo:
    peer: bytes
    addrs: tuple[str, ...]
    connected: bool
    up: bool  # heartbeat state
    rtt_ms: float  # -1 if unknown
    queue_depth: int
    active: int
    n_hashes: int  # estimated cached blocks (from digests)
    digest_age_s: float  # -1 if no digest yet
    sources: tuple[str, ...] = ()  # how this node learned the peer (bootstrap, gossip, dht, mdns)
    model: bytes = b""  # the model fingerprint it announced (b"": not known); 11th field


@dataclass(frozen=True)
class PeersReply:
    self_peer: bytes
    model: bytes  # model fingerprint (clients derive namespace keys from it)
    addrs: tuple[str, ...]
    peers: tuple[PeerInfo, ...]
    stats: dict[str, int]  # counters (records applied/rejected by class, ...)
    # the models the mesh serves now as this node sees it (core/models.catalog; key "mm",
    # omitted when empty): clients resolve a model name with it
    models: tuple[ModelEntry, ...] = ()


Frame = Request | Tokens | Final | End | Error | Ping | Pong | PeersQuery | PeersReply


# --- encoding ---------------------------------------------------------------------------


def _hop_obj(h: Hop) -> dict[str, Any]:
    return {
        "p": h.peer,
        "a": h.action,
        "r": h.reason,
        "n": h.next_peer,
        "m": h.local_matched_tokens,
        "el": float(h.est_local_s),
        "ep": float(h.est_peer_s),
        "d": float(h.decide_ms),
        "f": float(h.ttft_ms),
    }


def _request_obj(frame: Request) -> dict[str, Any]:
    s = frame.sampling
    obj = {
        "t": "req",
        "id": frame.id,
        "ns": frame.ns,
        "cr": frame.credential,
        "msg": [[m.role, m.content] for m in frame.messages],
        "tok": _pack_ids(frame.tokens),
        "s": [s.max_tokens, float(s.temperature), float(s.top_p), s.seed],
        "dl": float(frame.deadline),
        "hb": frame.hop_budget,
        "v": list(frame.visited),
        "tr": [_hop_obj(h) for h in frame.trace],
        "st": frame.stream,
    }
    if frame.holders:  # omitted when empty: full-replication requests are unchanged
        obj["ho"] = [[p, b] for p, b in frame.holders]
    if frame.grammar:  # omitted when empty: unconstrained requests are unchanged
        obj["gr"] = frame.grammar
    if frame.logprobs >= 0:
        obj["lp"] = frame.logprobs
    if frame.model:
        obj["mo"] = frame.model
    if frame.prompt:
        obj["pr"] = frame.prompt
    return obj


def _tokens_obj(frame: Tokens) -> dict[str, Any]:
    obj = {"t": "tok", "x": frame.text, "ids": _pack_ids(frame.token_ids)}
    if frame.logprobs:
        obj["lp"] = [[e.piece, float(e.logprob), [[b, float(lp)] for b, lp in e.top]]
                     for e in frame.logprobs]
    if frame.prompt_tokens:
        obj["pt"] = frame.prompt_tokens
        if frame.cached_tokens >= 0:
            obj["ct"] = frame.cached_tokens
    elif frame.cached_tokens >= 0:
        obj["ct"] = frame.cached_tokens  # refused by the decoder: "ct" comes with "pt"
    return obj


def _final_obj(frame: Final) -> dict[str, Any]:
    obj = {
        "t": "fin",
        "id": frame.id,
        "en": frame.entry,
        "sv": frame.serving,
        "pt": frame.prompt_tokens,
        "ct": frame.cached_tokens,
        "gt": frame.completion_tokens,
        "tt": float(frame.ttft_ms),
        "tm": float(frame.total_ms),
        "fr": frame.finish_reason,
        "hp": [_hop_obj(h) for h in frame.hops],
    }
    if frame.batched:
        obj["b"] = True
    return obj


def _pong_obj(frame: Pong) -> dict[str, Any]:
    obj = {"t": "pong", "n": frame.nonce, "q": frame.queue_depth, "a": frame.active}
    if frame.summary_hash:
        obj["h"] = frame.summary_hash
    if frame.n_ctx:
        obj["c"] = frame.n_ctx
    if frame.model:
        obj["mo"] = [frame.model, frame.model_name]
    return obj


def _peer_info_obj(p: PeerInfo) -> list[Any]:
    row = [p.peer, list(p.addrs), p.connected, p.up, float(p.rtt_ms), p.queue_depth, p.active,
           p.n_hashes, float(p.digest_age_s), list(p.sources)]  # fmt: skip
    return [*row, p.model] if p.model else row


def _peers_reply_obj(frame: PeersReply) -> dict[str, Any]:
    obj = {
        "t": "pr",
        "me": frame.self_peer,
        "md": frame.model,
        "ad": list(frame.addrs),
        "ps": [_peer_info_obj(p) for p in frame.peers],
        "sx": dict(frame.stats),
    }
    if frame.models:
        obj["mm"] = [[m.fingerprint, m.name, m.nodes, m.local] for m in frame.models]
    return obj


#: The encoder of each frame class (``_DECODERS`` below is its decoding counterpart).
_ENCODERS: dict[type, Callable[[Any], dict[str, Any]]] = {
    Request: _request_obj,
    Tokens: _tokens_obj,
    Final: _final_obj,
    End: lambda f: {"t": "end"},
    Error: lambda f: {"t": "err", "c": f.code, "m": f.message},
    Ping: lambda f: {"t": "ping", "n": f.nonce},
    Pong: _pong_obj,
    PeersQuery: lambda f: {"t": "pq"},
    PeersReply: _peers_reply_obj,
}


def _to_obj(frame: Frame) -> dict[str, Any]:
    encoder = _ENCODERS.get(type(frame))
    if encoder is None:
        raise TypeError(f"not a frame: {type(frame).__name__}")
    return encoder(frame)


def encode_frame(frame: Frame) -> bytes:
    """Length prefix + canonical CBOR body. Validates the frame exactly as a decoder
    would, so a node can never emit a frame its peers must reject."""
    obj = _to_obj(frame)
    _from_obj(obj)  # the receiving side's schema checks (obj holds exactly CBOR's types)
    body = cbor2.dumps(obj, canonical=True)
    if len(body) > MAX_FRAME_BYTES:
        raise OversizeFrame(f"frame body of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return struct.pack(">I", len(body)) + body


# --- decoding: the bounded pre-scan and cbor2 (overlay/core/cbor.py), then a schema check


def decode_body(body: bytes) -> Frame:
    """Decode one frame body (without its length prefix); raises :class:`WireError`."""
    if len(body) > MAX_FRAME_BYTES:
        raise OversizeFrame(f"frame body of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        obj = cbor.loads(body, max_depth=MAX_CBOR_DEPTH, max_items=MAX_CBOR_ITEMS)
    except cbor.TooManyItems as exc:
        raise LimitExceeded(f"frame has {exc}") from None
    except cbor.CborError as exc:
        raise MalformedFrame(str(exc)) from None
    frame = _from_obj(obj)
    try:
        canonical = cbor2.dumps(obj, canonical=True)
    except Exception as exc:  # pragma: no cover - decoded objects always re-encode
        raise MalformedFrame(f"frame does not re-encode: {exc}") from None
    if canonical != body:
        raise NonCanonicalFrame("frame body is not canonical CBOR")
    return frame


class _Fields:
    """Typed access to a decoded CBOR map; every failure is an :class:`InvalidField`."""

    def __init__(self, obj: Any, what: str, keys: Sequence[str]):
        if not isinstance(obj, dict):
            raise InvalidField(f"{what}: expected a map, got {type(obj).__name__}")
        extra = set(obj) - set(keys)
        if extra:
            raise InvalidField(f"{what}: unexpected keys {sorted(map(repr, extra))[:4]}")
        missing = [k for k in keys if k not in obj]
        if missing:
            raise InvalidField(f"{what}: missing keys {missing}")
        self.obj = obj
        self.what = what

    def int(self, key: str, lo: int, hi: int) -> int:
        return _int(self.obj[key], f"{self.what}.{key}", lo, hi)

    def float(self, key: str, lo: float, hi: float) -> float:
        return _float(self.obj[key], f"{self.what}.{key}", lo, hi)

    def str(self, key: str, max_chars: int) -> str:
        return _str(self.obj[key], f"{self.what}.{key}", max_chars)

    def bytes(self, key: str, max_bytes: int, exact: int | None = None) -> bytes:
        return _bytes(self.obj[key], f"{self.what}.{key}", max_bytes, exact)

    def bool(self, key: str) -> bool:
        v = self.obj[key]
        if not isinstance(v, bool):
            raise InvalidField(f"{self.what}.{key}: expected a bool")
        return v

    def list(self, key: str, max_items: int) -> list[Any]:
        return _list(self.obj[key], f"{self.what}.{key}", max_items)


def _int(v: Any, what: str, lo: int, hi: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise InvalidField(f"{what}: expected an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise LimitExceeded(f"{what}: {v} outside [{lo}, {hi}]")
    return v


def _float(v: Any, what: str, lo: float, hi: float) -> float:
    if not isinstance(v, float):
        raise InvalidField(f"{what}: expected a float, got {type(v).__name__}")
    if math.isnan(v) or not lo <= v <= hi:
        raise LimitExceeded(f"{what}: {v} outside [{lo}, {hi}]")
    return v


def _str(v: Any, what: str, max_chars: int) -> str:
    if not isinstance(v, str):
        raise InvalidField(f"{what}: expected text, got {type(v).__name__}")
    if len(v) > max_chars:
        raise LimitExceeded(f"{what}: {len(v)} characters exceed {max_chars}")
    return v


def _bytes(v: Any, what: str, max_bytes: int, exact: int | None = None) -> bytes:
    if not isinstance(v, bytes):
        raise InvalidField(f"{what}: expected bytes, got {type(v).__name__}")
    if len(v) > max_bytes:
        raise LimitExceeded(f"{what}: {len(v)} bytes exceed {max_bytes}")
    if exact is not None and len(v) != exact:
        raise InvalidField(f"{what}: expected {exact} bytes, got {len(v)}")
    return v


def _list(v: Any, what: str, max_items: int) -> list[Any]:
    if not isinstance(v, list):
        raise InvalidField(f"{what}: expected an array, got {type(v).__name__}")
    if len(v) > max_items:
        raise LimitExceeded(f"{what}: {len(v)} items exceed {max_items}")
    return v


_BIG = 1e12
_HOP_ACTIONS = frozenset({"serve", "forward", "fallback"})


def _hop_from(obj: Any, what: str) -> Hop:
    f = _Fields(obj, what, ("p", "a", "r", "n", "m", "el", "ep", "d", "f"))
    action = f.str("a", MAX_SHORT_STRING)
    if action not in _HOP_ACTIONS:
        raise InvalidField(f"{what}.a: unknown action {action!r}")
    return Hop(
        peer=f.bytes("p", MAX_ID_BYTES),
        action=action,
        reason=f.str("r", MAX_SHORT_STRING),
        next_peer=f.bytes("n", MAX_ID_BYTES),
        local_matched_tokens=f.int("m", 0, MAX_PROMPT_TOKENS),
        est_local_s=f.float("el", -1.0, _BIG),
        est_peer_s=f.float("ep", -1.0, _BIG),
        decide_ms=f.float("d", 0.0, _BIG),
        ttft_ms=f.float("f", -1.0, _BIG),
    )


def _hops(f: _Fields, key: str) -> tuple[Hop, ...]:
    return tuple(_hop_from(h, f"{f.what}.{key}[{i}]") for i, h in enumerate(f.list(key, MAX_HOPS)))


def _holders(f: _Fields) -> tuple[tuple[bytes, int], ...]:
    items = f.list("ho", MAX_CARRIED_HOLDERS)
    if not items:
        raise InvalidField("request.ho: an empty holder list is sent by omitting the key")
    out = []
    for i, item in enumerate(items):
        pair = _list(item, f"request.ho[{i}]", 2)
        if len(pair) != 2:
            raise InvalidField(f"request.ho[{i}]: expected [peer, blocks]")
        out.append((_bytes(pair[0], f"request.ho[{i}].peer", MAX_ID_BYTES),
                    _int(pair[1], f"request.ho[{i}].blocks", 1, MAX_PROMPT_TOKENS)))
    if len({p for p, _ in out}) != len(out):
        raise InvalidField("request.ho: a peer is listed twice")
    return tuple(out)


def _pack_ids(ids) -> bytes:
    """Token ids as one byte string of u32 little-endian values: a 650-token prompt
    decodes ~10x faster than as a CBOR array of ints (no per-item scan)."""
    try:
        return struct.pack(f"<{len(ids)}I", *ids)
    except struct.error:
        raise InvalidField("token ids must be integers in [0, 2**32)") from None


def _token_ids(f: _Fields, key: str, max_items: int) -> tuple[int, ...]:
    data = f.bytes(key, 4 * max_items)
    if len(data) % 4:
        raise InvalidField(f"{f.what}.{key}: {len(data)} bytes is not a whole number of u32 ids")
    return struct.unpack(f"<{len(data) // 4}I", data)


def _messages(f: _Fields) -> tuple[Message, ...]:
    messages = []
    for i, m in enumerate(f.list("msg", MAX_MESSAGES)):
        pair = _list(m, f"request.msg[{i}]", 2)
        if len(pair) != 2:
            raise InvalidField(f"request.msg[{i}]: expected [role, content]")
        messages.append(
            Message(
                _str(pair[0], f"request.msg[{i}].role", MAX_SHORT_STRING),
                _str(pair[1], f"request.msg[{i}].content", MAX_TEXT_CHARS),
            )
        )
    return tuple(messages)


def _sampling(v: Any) -> Sampling:
    s = _list(v, "request.s", 4)
    if len(s) != 4:
        raise InvalidField("request.s: expected [max_tokens, temperature, top_p, seed]")
    return Sampling(
        max_tokens=_int(s[0], "request.s.max_tokens", 0, MAX_MAX_TOKENS),
        temperature=_float(s[1], "request.s.temperature", 0.0, 100.0),
        top_p=_float(s[2], "request.s.top_p", 0.0, 1.0),
        seed=_int(s[3], "request.s.seed", 0, 0xFFFFFFFF),
    )


def _request_from(obj: dict) -> Request:
    keys = ("t", "id", "ns", "cr", "msg", "tok", "s", "dl", "hb", "v", "tr", "st")
    optional = ("ho", "gr", "lp", "mo", "pr")
    f = _Fields(obj, "request", (*keys, *(k for k in optional if k in obj)))
    messages = _messages(f)
    tokens = _token_ids(f, "tok", MAX_PROMPT_TOKENS)
    prompt = _raw_prompt(f) if "pr" in obj else ""
    if prompt and (messages or tokens):
        raise InvalidField("request.pr: a raw prompt travels instead of messages and tokens")
    if not messages and not tokens and not prompt:
        raise InvalidField("request: neither messages, tokens nor a raw prompt")
    sampling = _sampling(obj["s"])
    visited = tuple(
        _bytes(v, f"request.v[{i}]", MAX_ID_BYTES) for i, v in enumerate(f.list("v", MAX_HOPS))
    )
    return Request(
        id=f.bytes("id", MAX_ID_BYTES),
        ns=f.bytes("ns", MAX_ID_BYTES),
        credential=f.bytes("cr", MAX_ID_BYTES),
        messages=messages,
        tokens=tokens,
        sampling=sampling,
        deadline=f.float("dl", 0.0, MAX_DEADLINE),
        hop_budget=f.int("hb", 0, MAX_HOPS),
        visited=visited,
        trace=_hops(f, "tr"),
        stream=f.bool("st"),
        holders=_holders(f) if "ho" in obj else (),
        grammar=_grammar(f) if "gr" in obj else "",
        logprobs=f.int("lp", 0, MAX_TOP_LOGPROBS) if "lp" in obj else -1,
        model=_model_fp(obj["mo"], "request.mo") if "mo" in obj else b"",
        prompt=prompt,
    )


def _model_fp(v: Any, what: str) -> bytes:
    fp = _bytes(v, what, MAX_MODEL_FP_BYTES)
    if not fp:
        raise InvalidField(f"{what}: an empty model fingerprint is sent by omitting the key")
    return fp


def _model_name(v: Any, what: str) -> str:
    name = _str(v, what, MAX_SHORT_STRING)
    if not valid_model_name(name):
        raise InvalidField(f"{what}: {name[:80]!r} is not a model name (core/models.py)")
    return name


def _raw_prompt(f: _Fields) -> str:
    text = f.str("pr", MAX_PROMPT_CHARS)
    if not text:
        raise InvalidField("request.pr: an empty raw prompt is sent by omitting the key")
    return text


def _grammar(f: _Fields) -> str:
    text = f.str("gr", MAX_GRAMMAR_CHARS)
    if not text:
        raise InvalidField("request.gr: an empty grammar is sent by omitting the key")
    if "\x00" in text:
        raise InvalidField("request.gr: NUL in the grammar")
    return text


def _logprob(v: Any, what: str) -> float:
    return _float(v, what, MIN_LOGPROB, 0.0)


def _logprob_entry(v: Any, what: str) -> TokenLogprob:
    e = _list(v, what, 3)
    if len(e) != 3:
        raise InvalidField(f"{what}: expected [piece, logprob, top]")
    top = []
    for j, alt in enumerate(_list(e[2], f"{what}.top", MAX_TOP_LOGPROBS)):
        pair = _list(alt, f"{what}.top[{j}]", 2)
        if len(pair) != 2:
            raise InvalidField(f"{what}.top[{j}]: expected [piece, logprob]")
        top.append((_bytes(pair[0], f"{what}.top[{j}].piece", MAX_PIECE_BYTES),
                    _logprob(pair[1], f"{what}.top[{j}].logprob")))
    return TokenLogprob(_bytes(e[0], f"{what}.piece", MAX_PIECE_BYTES),
                        _logprob(e[1], f"{what}.logprob"), tuple(top))


def _tokens_from(obj: dict) -> Tokens:
    f = _Fields(obj, "tokens", ("t", "x", "ids", *(k for k in ("lp", "pt", "ct") if k in obj)))
    logprobs: tuple[TokenLogprob, ...] = ()
    if "lp" in obj:
        items = f.list("lp", MAX_LOGPROB_ENTRIES)
        if not items:
            raise InvalidField("tokens.lp: an empty list is sent by omitting the key")
        logprobs = tuple(_logprob_entry(v, f"tokens.lp[{i}]") for i, v in enumerate(items))
    if "ct" in obj and "pt" not in obj:
        raise InvalidField("tokens.ct: a cached count comes with the prompt count ('pt')")
    # an unknown count is sent by omitting the key, never as 0
    prompt_tokens = f.int("pt", 1, MAX_PROMPT_TOKENS) if "pt" in obj else 0
    return Tokens(text=f.str("x", MAX_TEXT_CHARS), token_ids=_token_ids(f, "ids", MAX_CHUNK_TOKENS),
                  logprobs=logprobs, prompt_tokens=prompt_tokens,
                  cached_tokens=f.int("ct", 0, prompt_tokens) if "ct" in obj else -1)


def _final_from(obj: dict) -> Final:
    f = _Fields(obj, "final", ("t", "id", "en", "sv", "pt", "ct", "gt", "tt", "tm", "fr", "hp")
                + (("b",) if "b" in obj else ()))
    if "b" in obj and not f.bool("b"):
        raise InvalidField("final.b: an unbatched answer is sent by omitting the key")
    prompt_tokens = f.int("pt", 0, MAX_PROMPT_TOKENS)
    cached = f.int("ct", 0, MAX_PROMPT_TOKENS)
    if cached > prompt_tokens:
        raise InvalidField("final: cached tokens exceed prompt tokens")
    return Final(
        id=f.bytes("id", MAX_ID_BYTES),
        entry=f.bytes("en", MAX_ID_BYTES),
        serving=f.bytes("sv", MAX_ID_BYTES),
        prompt_tokens=prompt_tokens,
        cached_tokens=cached,
        completion_tokens=f.int("gt", 0, MAX_MAX_TOKENS),
        ttft_ms=f.float("tt", -1.0, _BIG),
        total_ms=f.float("tm", -1.0, _BIG),
        finish_reason=f.str("fr", MAX_SHORT_STRING),
        hops=_hops(f, "hp"),
        batched="b" in obj,
    )


def _end_from(obj: dict) -> End:
    _Fields(obj, "end", ("t",))
    return End()


def _error_from(obj: dict) -> Error:
    f = _Fields(obj, "error", ("t", "c", "m"))
    code = f.str("c", MAX_SHORT_STRING)
    if code not in ERROR_CODES:
        raise InvalidField(f"error: unknown code {code!r}")
    return Error(code=code, message=f.str("m", MAX_ERROR_CHARS))


def _ping_from(obj: dict) -> Ping:
    f = _Fields(obj, "ping", ("t", "n"))
    return Ping(nonce=f.int("n", 0, 2**63 - 1))


def _pong_from(obj: dict) -> Pong:
    keys = ("t", "n", "q", "a") + tuple(k for k in ("h", "c", "mo") if k in obj)
    f = _Fields(obj, "pong", keys)
    summary_hash = f.bytes("h", MAX_SUMMARY_HASH_BYTES) if "h" in obj else b""
    if "h" in obj and not summary_hash:
        raise InvalidField("pong.h: an empty summary hash is sent by omitting the key")
    return Pong(
        nonce=f.int("n", 0, 2**63 - 1),
        queue_depth=f.int("q", 0, 2**31 - 1),
        active=f.int("a", 0, 2**31 - 1),
        summary_hash=summary_hash,
        # an unknown context is sent by omitting the key, never as 0
        n_ctx=f.int("c", 1, 2**31 - 1) if "c" in obj else 0,
        **(_pong_model(f.list("mo", 2)) if "mo" in obj else {}),
    )


def _pong_model(pair: list[Any]) -> dict[str, Any]:
    if len(pair) != 2:
        raise InvalidField("pong.mo: expected [fingerprint, name]")
    return {"model": _model_fp(pair[0], "pong.mo.fingerprint"),
            "model_name": _model_name(pair[1], "pong.mo.name")}


def _peers_query_from(obj: dict) -> PeersQuery:
    _Fields(obj, "peers_query", ("t",))
    return PeersQuery()


def _peer_info_from(p: Any, w: str) -> PeerInfo:
    row = _list(p, w, 11)
    if len(row) not in (10, 11):
        raise InvalidField(f"{w}: expected 10 fields, or 11 with the model")
    return PeerInfo(
        peer=_bytes(row[0], w + ".peer", MAX_ID_BYTES),
        addrs=tuple(
            _str(a, w + ".addrs", MAX_SHORT_STRING) for a in _list(row[1], w + ".addrs", MAX_ADDRS)
        ),
        connected=bool(row[2]) if isinstance(row[2], bool) else _bad(w + ".connected"),
        up=bool(row[3]) if isinstance(row[3], bool) else _bad(w + ".up"),
        rtt_ms=_float(row[4], w + ".rtt_ms", -1.0, _BIG),
        queue_depth=_int(row[5], w + ".queue_depth", 0, 2**31 - 1),
        active=_int(row[6], w + ".active", 0, 2**31 - 1),
        n_hashes=_int(row[7], w + ".n_hashes", 0, 2**31 - 1),
        digest_age_s=_float(row[8], w + ".digest_age_s", -1.0, _BIG),
        sources=tuple(
            _str(x, w + ".sources", MAX_SHORT_STRING) for x in _list(row[9], w + ".sources", 8)
        ),
        model=_model_fp(row[10], w + ".model") if len(row) == 11 else b"",
    )


def _model_entries(f: _Fields) -> tuple[ModelEntry, ...]:
    items = f.list("mm", MAX_MODELS_LISTED)
    if not items:
        raise InvalidField("peers_reply.mm: an empty model list is sent by omitting the key")
    out = []
    for i, item in enumerate(items):
        w = f"peers_reply.mm[{i}]"
        row = _list(item, w, 4)
        if len(row) != 4 or not isinstance(row[3], bool):
            raise InvalidField(f"{w}: expected [fingerprint, name, nodes, local]")
        out.append(ModelEntry(_model_fp(row[0], w + ".fingerprint"),
                              _model_name(row[1], w + ".name"),
                              _int(row[2], w + ".nodes", 1, 2**31 - 1), row[3]))
    if len({m.fingerprint for m in out}) != len(out):
        raise InvalidField("peers_reply.mm: a model is listed twice")
    return tuple(out)


def _peers_reply_from(obj: dict) -> PeersReply:
    f = _Fields(obj, "peers_reply", ("t", "me", "md", "ad", "ps", "sx")
                + (("mm",) if "mm" in obj else ()))
    peers = tuple(
        _peer_info_from(p, f"peers_reply.ps[{i}]")
        for i, p in enumerate(f.list("ps", MAX_PEERS_LISTED))
    )
    stats_obj = obj["sx"]
    if not isinstance(stats_obj, dict) or len(stats_obj) > 256:
        raise InvalidField("peers_reply.sx: expected a map of at most 256 counters")
    stats = {
        _str(k, "peers_reply.sx key", MAX_SHORT_STRING): _int(v, "peers_reply.sx", 0, 2**63 - 1)
        for k, v in stats_obj.items()
    }
    return PeersReply(
        self_peer=f.bytes("me", MAX_ID_BYTES),
        model=f.bytes("md", MAX_ID_BYTES),
        addrs=tuple(_str(a, "peers_reply.ad", MAX_SHORT_STRING) for a in f.list("ad", MAX_ADDRS)),
        peers=peers,
        stats=stats,
        models=_model_entries(f) if "mm" in obj else (),
    )


#: The decoder of each frame type, by its ``"t"`` value (the one place a type is named
#: on the decoding side; ``_to_obj`` is its encoding counterpart).
_DECODERS: dict[str, Callable[[dict], Frame]] = {
    "req": _request_from,
    "tok": _tokens_from,
    "fin": _final_from,
    "end": _end_from,
    "err": _error_from,
    "ping": _ping_from,
    "pong": _pong_from,
    "pq": _peers_query_from,
    "pr": _peers_reply_from,
}


def _from_obj(obj: Any) -> Frame:
    if not isinstance(obj, dict):
        raise MalformedFrame(f"frame is not a map but {type(obj).__name__}")
    t = obj.get("t")
    if not isinstance(t, str):
        raise UnknownFrameType(f"frame type {t!r} is not text")
    decoder = _DECODERS.get(t)
    if decoder is None:
        raise UnknownFrameType(f"unknown frame type {t[:32]!r}")
    return decoder(obj)


def _bad(what: str) -> bool:
    raise InvalidField(f"{what}: expected a bool")


class FrameDecoder:
    """Incremental decoder: feed it byte chunks of any size, take frames out.

    The buffer is bounded: as soon as a length prefix announces more than
    :data:`MAX_FRAME_BYTES`, :meth:`feed`/:meth:`next_frame` raise :class:`OversizeFrame`
    without buffering the body. After any :class:`WireError` the decoder is poisoned (the
    stream is out of sync) and keeps raising the same error.
    """

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES):
        self.max_frame_bytes = min(max_frame_bytes, MAX_FRAME_BYTES)
        self._buf = bytearray()
        self._error: WireError | None = None
        self.frames_decoded = 0
        self.bytes_fed = 0

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes) -> None:
        if self._error is not None:
            raise self._error
        self.bytes_fed += len(data)
        self._buf += data
        self._check_prefix()
        # bound: one announced frame plus (at most) the next prefix; more is a sender
        # that does not wait for replies, which no protocol here allows
        if len(self._buf) > LENGTH_PREFIX_BYTES + self.max_frame_bytes + 2 * LENGTH_PREFIX_BYTES:
            self._error = OversizeFrame(f"more than {self.max_frame_bytes} bytes buffered")
            raise self._error

    def _check_prefix(self) -> None:
        if len(self._buf) >= LENGTH_PREFIX_BYTES:
            (length,) = struct.unpack_from(">I", self._buf)
            if length > self.max_frame_bytes:
                self._error = OversizeFrame(
                    f"frame announces {length} bytes, limit {self.max_frame_bytes}"
                )
                raise self._error

    def next_frame(self) -> Frame | None:
        """The next complete frame, or None if more bytes are needed."""
        if self._error is not None:
            raise self._error
        if len(self._buf) < LENGTH_PREFIX_BYTES:
            return None
        self._check_prefix()
        (length,) = struct.unpack_from(">I", self._buf)
        end = LENGTH_PREFIX_BYTES + length
        if len(self._buf) < end:
            return None
        body = bytes(self._buf[LENGTH_PREFIX_BYTES:end])
        del self._buf[:end]
        try:
            frame = decode_body(body)
        except WireError as exc:
            self._error = exc
            raise
        self.frames_decoded += 1
        return frame

    def frames(self) -> Iterator[Frame]:
        while (frame := self.next_frame()) is not None:
            yield frame

    def eof(self) -> None:
        """The stream ended: raises :class:`TruncatedFrame` if a partial frame is buffered."""
        if self._error is not None:
            raise self._error
        if self._buf:
            self._error = TruncatedFrame(
                f"stream ended with {len(self._buf)} bytes of a partial frame"
            )
            raise self._error


class InferStreamState:
    """Order of frames on one ``/prefixmesh/infer`` stream, for either side.

    States: ``awaiting_request`` -> ``streaming`` -> (FINAL) ``finalised`` -> (END)
    ``done``; ERROR from ``streaming``/``finalised`` -> ``failed``. The requester drives
    it with :meth:`request_sent` then :meth:`on_response`; the server with
    :meth:`request_received` then :meth:`response_sent`. Same transitions, so both sides
    agree on what is legal; any other order raises :class:`ProtocolViolation`.
    """

    AWAITING_REQUEST = "awaiting_request"
    STREAMING = "streaming"
    FINALISED = "finalised"
    DONE = "done"
    FAILED = "failed"

    def __init__(self) -> None:
        self.state = self.AWAITING_REQUEST
        self.tokens_frames = 0

    @property
    def finished(self) -> bool:
        return self.state in (self.DONE, self.FAILED)

    def _request(self, frame: Frame) -> None:
        if self.state != self.AWAITING_REQUEST:
            raise ProtocolViolation(f"REQUEST in state {self.state}")
        if not isinstance(frame, Request):
            raise ProtocolViolation(f"expected REQUEST, got {type(frame).__name__.upper()}")
        self.state = self.STREAMING

    def _response(self, frame: Frame) -> None:
        s = self.state
        if isinstance(frame, Tokens) and s == self.STREAMING:
            self.tokens_frames += 1
        elif isinstance(frame, Final) and s == self.STREAMING:
            self.state = self.FINALISED
        elif isinstance(frame, End) and s == self.FINALISED:
            self.state = self.DONE
        elif isinstance(frame, Error) and s in (self.STREAMING, self.FINALISED):
            self.state = self.FAILED
        else:
            raise ProtocolViolation(f"{type(frame).__name__.upper()} not allowed in state {s}")

    request_sent = _request
    request_received = _request
    on_response = _response
    response_sent = _response
