"""The inference engine: one llama.cpp model, a KV store of prompt prefixes, one worker thread.

Serve path of a request (prompt token ids P, namespace ns):

1. look up the longest cached prefix of the prompt *body* ``P[:-1]`` in ns (RAM or disk
   tier of the :class:`~prefixmesh.inference.kvstore.KVStore`);
2. clear the context, restore the saved chain of per-sequence states with
   ``llama_state_seq_set_data`` (a whole prefix, then each segment through scratch
   sequence 1, joined with ``llama_memory_seq_cp``) and, when the saved entry is longer
   than the match, cut it back with ``llama_memory_seq_rm``;
3. evaluate only the rest of the prompt, its last token included (in chunks of 2..n_batch
   tokens: one pass over the weights for a short new suffix);
4. sample (greedy, or seeded temperature/top-k/top-p in numpy: deterministic for a given
   seed and logits) and stream token pieces until EOS/EOG, ``max_tokens`` or cancellation;
   a request with a grammar (``SamplingParams.grammar``, llama.cpp GBNF) samples only
   tokens the grammar allows (:class:`_Grammar`), and one asking for logprobs gets each
   token's log probability and the most likely alternatives (:func:`_logprobs`);
5. save snapshots of the snapshot points no stored entry covers yet: after generation, so
   that saving costs no time to first token. Each is a *segment*: only the cells past the
   longest stored prefix of the point (copied to sequence 1, ``llama_state_seq_get_data``
   of that sequence), so a prefix shared by many prompts is stored once and bytes grow
   with unique tokens. A prompt that diverged from a stored state at L tokens makes L a
   stored branch point and the other state is rebased onto it (see ``_save_snapshots``).

Persistence: the store writes every new state to disk behind the engine's back
(write-behind, within ``write_delay_s``); start-up reads only file headers. KV cache
element types (``type_k``/``type_v``) and the sequence layout are part of the state
fingerprint, so states of different settings never mix. Measurements: docs/bench/engine.md.

Bit-identical results. Greedy output through any restore path equals a cold run of the
same engine. Restoring copies the exact KV cells; what needs care is that the CPU kernels
give slightly different results for a batch of ONE token (vector dot-product path) than
for the same token inside a larger batch (GEMM path), and the difference shows up a few
generated tokens later. Hence the batch discipline: a prompt, its last token included, is
always evaluated in chunks of >= 2 tokens; a restore or a live prefix leaves at least the
last 2 prompt tokens to evaluate (an exact repeat of a stored prompt restores all but 2);
snapshots hold body prefixes only (all prompt tokens but the last), and generated tokens,
computed alone, are never part of one. (Until issue 17 the last prompt token was evaluated
alone: a second pass over the weights on every request, ~15 % of a warm TTFT; greedy
outputs of this discipline differ from that one's, stored states are the same.)
``use_extra_bufts`` is also turned off at load so that repacked-weight kernels
(Q4_0/Q4_K/IQ4_NL) cannot make results depend on the batch split.

Snapshot policy (``EngineConfig.snapshot_policy``):
- ``"end"`` (default): one snapshot of the prompt body. Any prefix of it is served from
  that one entry by truncation, so shorter points would only duplicate bytes.
- ``"boundaries"``: also at every verified message boundary of the prompt (see
  :mod:`.chat`) of at least ``min_snapshot_tokens`` tokens; this keeps a short shared
  prefix (e.g. a system prompt) as its own small entry that survives eviction of the long
  ones and restores faster. Points closer than ``min_snapshot_tokens`` to each other or to
  the body's end are skipped.
A point gets no snapshot when a stored entry already covers it.

Threading. A ``llama_cpp.Llama`` object must only ever be used from one thread (two
threads abort the process), so the engine owns one worker thread that loads the model and
runs every llama call. Requests go through a bounded queue (``max_queue``; a full queue
raises :class:`EngineBusy`). Tokenisation/chat rendering (read-only vocabulary) and the KV
store lookups (under a lock) may be called from any thread. Cancellation of a queued or
running request is checked between prefill chunks and between generated tokens.

Batch modes (``EngineConfig.batch_mode``). ``"deterministic"`` (the default, on CPU and on
GPU) is all of the above: one request at a time in sequence 0, so every greedy answer is
bit-identical to a cold run, which spot checks and mid-stream resume rely on.
``"throughput"`` is continuous batching (:meth:`Engine._run_batched`): up to ``max_batch``
requests each hold a sequence of a unified KV cache (``n_seq_max = max_batch + 1``, the
last one scratch) and every step is ONE ``llama_decode`` carrying the next token of every
decoding request and prompt chunks of prefilling ones; a request that arrives while
others decode joins at the next step; a new prefix wanted by several concurrent requests
is prefilled once and the others copy its cells (``llama_memory_seq_cp``, waiting while
it is still being prefilled). A row's result depends on how many rows its batch has, so a
throughput-mode answer may differ from the deterministic one after a few tokens (measured:
docs/bench/engine.md, section 5); every answer carries ``RequestStats.batch_mode`` so
that answers are only ever compared within one mode, and the mode is part of the state
fingerprint, so states of the two modes never mix. A finished request's prompt cells stay
resident in its sequence until the sequence or its cells are needed (a later request
sharing the prefix copies them: nothing restored), and while sequences decode a step
carries at most ``_PREFILL_TOKENS_WHILE_DECODING`` prompt tokens (a long new prompt does
not stall their next tokens for a whole n_batch). Throughput mode saves the body of each
request as a segment (no branch-point rebase: other sequences hold the context), ignores
``live_sequence`` and ``snapshot_policy="boundaries"``, and admits a request only when
its KV cells fit (``n_ctx`` is shared by all sequences; copied prefix cells count once).

Cache events. Every time a prefix becomes cached (first tier) or stops being cached (left
both tiers), the registered callback gets a :class:`CacheEvent` with the block-hash chain of
its tokens under the namespace key. Callbacks run on the thread that changed the store
(normally the worker): keep them short and thread-safe (e.g. ``trio.from_thread``).
Prefixes of a namespace the engine does not know the key of (found on disk at start)
are announced when the namespace is registered (:meth:`Engine.register_namespace`).
"""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import hashlib
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .chat import ChatError, ChatRenderer, EmptyPromptError, RenderedChat, UnknownRoleError
from .core.blocks import chain_hashes, derive_namespace_key, namespace_id
from .core.cells import CellLedger
from .kvstore import FINGERPRINT_BYTES, KVStore, Lease, StoreChange
from .model import GGUFError, cache_dir, read_gguf_info, resolve_model
from .options import BATCH_MODES, KV_TYPES

__all__ = [
    "Namespace",
    "CacheEvent",
    "SamplingParams",
    "EngineConfig",
    "KV_TYPES",
    "BATCH_MODES",
    "TokenPiece",
    "RequestStats",
    "Completion",
    "EngineLoad",
    "RequestHandle",
    "Engine",
    "EngineError",
    "ModelLoadError",
    "EngineBusy",
    "EngineClosed",
    "ContextOverflowError",
    "InvalidRequestError",
    "EmptyPromptError",
    "UnknownRoleError",
    "ChatError",
]

log = logging.getLogger(__name__)

# Sequence 0 serves requests; sequence 1 is scratch for moving segment states in and out
# (a unified KV cache, so llama_memory_seq_cp between them only relabels cells).
_N_SEQ = 2
# llama_memory_clear's data flag: False forgets the cells without zeroing the buffers.
# Zeroing costs ~42 ms at n_ctx 8192 (measured) on every restore and changes no result:
# cells no sequence holds are masked out of attention (weight exactly 0), as after the
# llama_memory_seq_rm calls that the live and batched paths have always relied on.
_ZERO_KV_BUFFERS = False
# throughput mode: prompt tokens per step while other sequences decode, so that a long new
# prompt delays their next tokens by ~128 token evaluations per step, not n_batch (on a CPU
# a step costs about the sum of its tokens: docs/bench/engine.md, section 7)
_PREFILL_TOKENS_WHILE_DECODING = 128
# throughput mode: a prefix held by another sequence is copied (no new KV cells, nothing
# read) rather than restored from the store unless the stored state is longer by more than
# this: evaluating a few tokens more costs less than a second copy of the whole prefix's
# cells (a 1,470-token prompt whose stored state was 1 token longer took 1,470 new cells)
_COPY_OVER_RESTORE_TOKENS = 16
# throughput mode: finished sequences whose prompt cells stay resident. One, like the
# deterministic live sequence: in a unified KV cache every step's attention spans all used
# cells, so 8 resident 533-token prompts made a warm request 1.7x slower, and 32 resident
# 136-token ones a cycled request 2.2x slower (measured, docs/bench/engine.md sections 7
# and 8; bench_residents) for prefixes the RAM tier restores in ~2-10 ms
_RESIDENT_SEQUENCES = 1

MAX_TOP_LOGPROBS = 20
_EWMA_ALPHA = 0.3
_MIN_PREFILL_FOR_RATE = 16
_load_lock = threading.Lock()


def _keep_stdio(disable: bool = True) -> contextlib.AbstractContextManager:
    """Stands in for llama-cpp-python's ``suppress_stdout_stderr`` during our load
    (``Engine._load_model``): leaves the process's stdout and stderr alone."""
    return contextlib.nullcontext()


# --------------------------------------------------------------------------- errors


class _KvFull(Exception):
    """``llama_decode`` found no free KV cells for a batch (its code 1): nothing of the
    batch was applied, so the step can be retried once room is made."""


class EngineError(Exception):
    """Base class of engine errors (chat rendering errors are :class:`ChatError`)."""


class ModelLoadError(EngineError):
    """The model file is missing, not a GGUF file, or llama.cpp refused to load it."""


class EngineBusy(EngineError):
    """The request queue is full: back off and retry, or route elsewhere."""


class EngineClosed(EngineError):
    """The engine has been closed (or its worker died)."""


class InvalidRequestError(EngineError, ValueError):
    """A request is malformed (bad sampling parameters, token ids out of range)."""


class ContextOverflowError(InvalidRequestError):
    """prompt tokens + max_tokens exceed the context size."""


# --------------------------------------------------------------------------- data types


@dataclass(frozen=True)
class Namespace:
    """A tenant namespace: ``key`` keys its block hashes, ``id`` names it publicly."""

    name: str
    key: bytes
    id: bytes

    @classmethod
    def derive(cls, name: str, secret: bytes, model_fingerprint: bytes) -> Namespace:
        key = derive_namespace_key(secret, name, model_fingerprint)
        return cls(name=name, key=key, id=namespace_id(key))

    @classmethod
    def public(cls, model_fingerprint: bytes, name: str = "public") -> Namespace:
        """A namespace anyone can compute (secret = the name itself)."""
        return cls.derive(name, name.encode("utf-8"), model_fingerprint)


@dataclass(frozen=True)
class CacheEvent:
    kind: str  # "add" | "remove"
    ns: bytes  # namespace id
    tokens_len: int
    chain: list[bytes]  # blocks.chain_hashes(ns key, tokens): whole 16-token blocks only


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    seed: int | None = None  # used when temperature > 0 (None: fresh entropy)
    top_k: int = 40  # 0 = off
    top_p: float = 0.95  # 1.0 = off
    # constrained output: a llama.cpp GBNF grammar (root rule "root") every sampled token
    # must follow; EOG is allowed only where the grammar is complete
    grammar: str | None = None
    # None: no logprobs; 0..MAX_TOP_LOGPROBS: each token's logprob and that many alternatives
    logprobs: int | None = None

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be an integer >= 1")
        if not self.temperature >= 0.0:
            raise InvalidRequestError("temperature must be >= 0")
        if self.top_k < 0 or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_k must be >= 0 and top_p in (0, 1]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        if self.grammar is not None and not self.grammar.strip():
            raise InvalidRequestError("the grammar is empty")


@dataclass
class EngineConfig:
    model_path: str | os.PathLike[str] | None = None  # None: the embedded default model
    n_ctx: int = 4096
    n_batch: int = 512
    n_threads: int | None = None  # None: all cores
    n_gpu_layers: int = 0  # CPU by default
    flash_attn: bool = False
    kv_dir: str | os.PathLike[str] | None = None  # None: <cache dir>/kv
    ram_budget_bytes: int = 1 << 30
    disk_budget_bytes: int = 8 << 30  # 0 disables the disk tier
    max_queue: int = 16
    snapshot_policy: str = "end"  # "end" | "boundaries"
    min_snapshot_tokens: int = 16
    # False: start-up indexes the disk tier from file headers and checks a file's checksum
    # when it is first loaded (ready at once); True: also checksum every file at start
    verify_on_start: bool = False
    fsync: bool = True
    # write-behind: a new state is on disk within this many seconds (a crash loses at most
    # that window); back-pressure also caps the queue at max_pending_write_bytes
    write_delay_s: float = 2.0
    max_pending_write_bytes: int = 256 << 20
    stop_timeout_s: float = 10.0  # close(): bound on waiting for the worker and the writer
    # KV cache element types ("f16", "q8_0", "q4_0", ...); quantized V needs flash_attn
    type_k: str = "f16"
    type_v: str = "f16"
    # keep the last request's prompt body live in sequence 0: a request that extends it
    # (a conversation's next turn) restores nothing (hit_tier "live")
    live_sequence: bool = False
    # "deterministic" (default): one request at a time, outputs bit-identical to a cold run
    # through every restore path; "throughput": continuous batching of up to max_batch
    # requests in shared llama_decode batches (outputs may differ from deterministic mode:
    # see the module docstring and docs/bench/engine.md, section 5)
    batch_mode: str = "deterministic"
    max_batch: int = 8
    seed: int = 0  # llama context seed (unused by our sampler; recorded for completeness)


@dataclass(frozen=True)
class TokenPiece:
    token: int
    text: str  # decoded text of this token (UTF-8 sequences split across tokens held back)
    # with SamplingParams.logprobs: the token's bytes, its log probability under the model
    # (raw logits, before temperature and any grammar mask) and the most likely tokens at
    # this step as (bytes, logprob), most likely first
    data: bytes = b""
    logprob: float | None = None
    top: tuple[tuple[bytes, float], ...] = ()


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens restored instead of evaluated
    hit_tier: str = "none"  # "live" | "ram" | "disk" | "none"
    prefill_tokens: int = 0  # prompt tokens evaluated
    completion_tokens: int = 0
    queue_wait_s: float = 0.0
    restore_s: float = 0.0
    prefill_s: float = 0.0
    ttft_s: float = 0.0  # service start -> first token sampled (excludes queue wait)
    decode_s: float = 0.0
    decode_tps: float = 0.0
    total_s: float = 0.0
    snapshots_saved: int = 0
    snapshot_s: float = 0.0  # saving snapshots after generation (not part of ttft_s)
    finish_reason: str = ""  # "stop" | "length" | "cancelled" | "error"
    # the engine mode that produced the answer: outputs of "deterministic" answers equal a
    # cold run; "throughput" answers were computed in shared batches (compare only within
    # the same mode)
    batch_mode: str = "deterministic"
    max_batch_seen: int = 1  # most sequences in one llama_decode call this request was in


@dataclass
class Completion:
    tokens: list[int]
    text: str
    finish_reason: str
    stats: RequestStats
    # the end-of-generation token that stopped it (finish "stop"; not part of tokens or
    # text), with its logprob entries when they were asked for: how clearly the model chose
    # to stop is what a spot check of a longer answer judges by
    end: TokenPiece | None = None


@dataclass(frozen=True)
class EngineLoad:
    queue_depth: int
    active: int
    prefill_tps: float  # EWMA of measured prompt tokens/s (0.0 until measured)
    decode_tps: float  # EWMA of measured generated tokens/s


# --------------------------------------------------------------------------- requests

_DONE = object()


class RequestHandle:
    """A submitted request. Iterate it for :class:`TokenPiece` s; ``result()`` waits."""

    def __init__(self, rid: int, tokens: tuple[int, ...], ns: Namespace, params: SamplingParams,
                 boundaries: tuple[int, ...], on_token: Callable[[TokenPiece], None] | None,
                 on_finish: Callable[[], None] | None = None):
        self.id = rid
        self.tokens = tokens
        self.ns = ns
        self.params = params
        self.boundaries = boundaries
        self.on_token = on_token
        # called once, on the finishing thread, after the last piece and the result are set
        # (a consumer that takes pieces from on_token learns the end here without a thread
        # blocked in iteration: the node's backend hands both straight to its trio loop)
        self.on_finish = on_finish
        self.submitted_at = time.perf_counter()
        self._cancel = threading.Event()
        self._done = threading.Event()
        self._pieces: queue.SimpleQueue = queue.SimpleQueue()
        self._completion: Completion | None = None
        self._error: BaseException | None = None
        self.grammar: _Grammar | None = None  # compiled at submission (params.grammar)
        # the running request's statistics, set when the engine starts it: cached_tokens is
        # final before the first piece (the node's backend reports it with that piece)
        self.stats: RequestStats | None = None

    def cancel(self) -> None:
        """Ask the engine to stop this request (queued: dropped; running: at the next token)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def __iter__(self) -> Iterator[TokenPiece]:
        while True:
            item = self._pieces.get()
            if item is _DONE:
                self._pieces.put(_DONE)  # later iterations end at once too
                if self._error is not None:
                    raise self._error
                return
            yield item

    def result(self, timeout: float | None = None) -> Completion:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} not finished after {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._completion is not None
        return self._completion

    # worker side
    def _emit(self, piece: TokenPiece) -> None:
        self._pieces.put(piece)
        if self.on_token is not None:
            try:
                self.on_token(piece)
            except Exception:
                log.exception("on_token callback of request %d failed", self.id)

    def _finish(self, completion: Completion | None, error: BaseException | None) -> None:
        if self.grammar is not None:
            self.grammar.close()
        self._completion, self._error = completion, error
        self._done.set()
        self._pieces.put(_DONE)
        if self.on_finish is not None:
            try:
                self.on_finish()
            except Exception:
                log.exception("on_finish callback of request %d failed", self.id)


# --------------------------------------------------------------------------- engine


class Engine:
    """See the module docstring. Construct, submit requests, ``close()`` when done."""

    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        cfg = replace(config or EngineConfig(), **overrides)
        if cfg.snapshot_policy not in ("end", "boundaries"):
            raise ValueError(f"unknown snapshot policy {cfg.snapshot_policy!r}")
        if cfg.n_batch < 4 or cfg.n_ctx < 8 or cfg.max_queue < 1:
            raise ValueError("need n_batch >= 4, n_ctx >= 8 and max_queue >= 1")
        for kv_type in (cfg.type_k, cfg.type_v):
            if kv_type not in KV_TYPES:
                raise ValueError(f"unknown KV cache type {kv_type!r} (one of {sorted(KV_TYPES)})")
        if cfg.batch_mode not in BATCH_MODES:
            raise ValueError(f"unknown batch mode {cfg.batch_mode!r} (one of {BATCH_MODES})")
        if cfg.batch_mode == "throughput" and not 1 <= cfg.max_batch <= min(63, cfg.n_batch):
            raise ValueError("max_batch must be in [1, min(63, n_batch)]")
        if cfg.type_v != "f16" and not cfg.flash_attn:
            # llama.cpp refuses a quantized V cache without flash attention
            raise ValueError("a quantized V cache (type_v) needs flash_attn=True")
        self.config = cfg
        # sequences: deterministic mode serves in 0 with scratch 1; throughput mode serves in
        # 0..max_batch-1 with scratch max_batch
        self._batched = cfg.batch_mode == "throughput"
        self._n_seq = cfg.max_batch + 1 if self._batched else _N_SEQ
        self._running: set[RequestHandle] = set()
        self._resident_max = _RESIDENT_SEQUENCES  # an attribute so that a probe can vary it
        # throughput mode: llama_decode calls, sequences and tokens over all of them
        # (and the most prompt tokens one step carried next to decoding sequences)
        # (and requests put back in the queue because the KV cache was full: "preempted")
        self.batch_counters = {"steps": 0, "sequences": 0, "tokens": 0,
                               "max_prefill_while_decoding": 0, "preempted": 0}
        try:
            self.model_path = resolve_model(cfg.model_path, progress=False)
            self.gguf = read_gguf_info(self.model_path)
        except FileNotFoundError as exc:
            raise ModelLoadError(str(exc)) from exc
        except GGUFError as exc:
            raise ModelLoadError(str(exc)) from exc
        self.model_fingerprint: bytes = self.gguf.fingerprint
        self.n_ctx = cfg.n_ctx
        self._namespaces: dict[bytes, Namespace] = {}
        self._event_cb: Callable[[CacheEvent], None] | None = None
        self._ns_lock = threading.RLock()
        self._queue: queue.Queue[RequestHandle | None] = queue.Queue(maxsize=cfg.max_queue)
        self._ids = itertools.count(1)
        self._active = 0
        self._prefill_tps = 0.0
        self._decode_tps = 0.0
        self._closed = False
        self._llama = None
        self._current: RequestHandle | None = None
        self._live: tuple[bytes, tuple[int, ...]] | None = None  # (ns, body) left in seq 0
        self._vocab_lock = threading.Lock()
        self._load_error: BaseException | None = None
        self._loaded = threading.Event()
        self._worker = threading.Thread(target=self._run, name="prefixmesh-engine", daemon=True)
        self._worker.start()
        self._loaded.wait()
        if self._load_error is not None:
            self._worker.join()
            raise self._load_error
        import llama_cpp

        self.state_fingerprint = hashlib.blake2b(
            b"prefixmesh-kv-state/v1\x00"
            + self.model_fingerprint
            + (f"|llama-cpp-python={llama_cpp.__version__}|flash_attn={cfg.flash_attn}"
            f"|type_k={cfg.type_k}|type_v={cfg.type_v}|extra_bufts=0|swa_full=1"
            f"|n_seq_max={self._n_seq}|kv_unified=1|segments=1"
            + ("" if cfg.batch_mode == "deterministic" else "|batch=throughput")
            ).encode(),
            digest_size=FINGERPRINT_BYTES,
        ).digest()
        kv_dir = Path(cfg.kv_dir) if cfg.kv_dir is not None else cache_dir() / "kv"
        self.store = KVStore(
            fingerprint=self.state_fingerprint,
            ram_budget_bytes=cfg.ram_budget_bytes,
            disk_budget_bytes=cfg.disk_budget_bytes,
            disk_dir=kv_dir if cfg.disk_budget_bytes > 0 else None,
            on_change=self._store_changed,
            verify_on_start=cfg.verify_on_start,
            fsync=cfg.fsync,
            write_delay_s=cfg.write_delay_s,
            max_pending_bytes=cfg.max_pending_write_bytes,
        )
        self.default_namespace = self.namespace("public")
        self.register_namespace(self.default_namespace)

    # ---------------------------------------------------------------- namespaces & events

    def namespace(self, name: str, secret: bytes | None = None) -> Namespace:
        """The namespace ``name`` for this model (``secret`` None: a public namespace)."""
        if secret is None:
            return Namespace.public(self.model_fingerprint, name)
        return Namespace.derive(name, secret, self.model_fingerprint)

    def register_namespace(self, ns: Namespace) -> None:
        """Make ``ns`` known so its cache events carry chains; announces its cached prefixes."""
        with self._ns_lock:
            if ns.id in self._namespaces:
                return
            self._namespaces[ns.id] = ns
            existing = [t for nid, t, _ in self.store.prefixes() if nid == ns.id]
        for tokens in existing:
            self._dispatch(CacheEvent("add", ns.id, len(tokens), chain_hashes(ns.key, tokens)))

    def set_event_callback(self, callback: Callable[[CacheEvent], None] | None) -> None:
        """Register the (single) cache event listener; None unregisters."""
        self._event_cb = callback

    def cached_prefixes(self) -> list[CacheEvent]:
        """An ``add`` event for every currently cached prefix of a registered namespace
        (for a listener that attaches after start)."""
        with self._ns_lock:
            items = self.store.prefixes()
            out = []
            for nid, tokens, _ in items:
                ns = self._namespaces.get(nid)
                if ns is not None:
                    out.append(CacheEvent("add", nid, len(tokens), chain_hashes(ns.key, tokens)))
            return out

    def _store_changed(self, change: StoreChange) -> None:
        ns = self._namespaces.get(change.ns_id)
        if ns is None:
            return  # announced by register_namespace
        self._dispatch(
            CacheEvent(change.kind, change.ns_id, len(change.tokens),
                       chain_hashes(ns.key, change.tokens))
        )

    def _dispatch(self, event: CacheEvent) -> None:
        cb = self._event_cb
        if cb is not None:
            try:
                cb(event)
            except Exception:
                log.exception("cache event callback failed")

    # ---------------------------------------------------------------- tokens & figures

    def render_chat(self, messages: object, tools: list | None = None) -> RenderedChat:
        """Render and tokenize a chat (thread-safe). Raises :class:`ChatError` subclasses.
        With ``tools`` (OpenAI tool objects) the model's template renders them and the
        tool conversation (``ChatRenderer.render_tools``; the template must support it)."""
        with self._vocab_lock:
            if self._llama is None:
                raise EngineClosed("the engine is closed")
            if tools is not None:
                return self._renderer.render_tools(messages, tools)
            return self._renderer.render(messages)

    def tokenize(self, text: str, *, special: bool = True) -> list[int]:
        """Token ids of ``text`` (no BOS added; special tokens parsed). Thread-safe."""
        with self._vocab_lock:
            if self._llama is None:
                raise EngineClosed("the engine is closed")
            return self._llama.tokenize(text.encode("utf-8"), add_bos=False, special=special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        with self._vocab_lock:
            if self._llama is None:
                raise EngineClosed("the engine is closed")
            return self._llama.detokenize(list(tokens)).decode("utf-8", "replace")

    def cached_tokens(self, ns: Namespace, tokens: Sequence[int]) -> tuple[int, str | None]:
        """How many leading tokens of ``tokens`` a request in ``ns`` would restore, and from
        which tier (capped at len(tokens) - 2: the batch discipline evaluates at least the
        last 2 prompt tokens together)."""
        if len(tokens) < 3:
            return 0, None
        n, tier = self.store.lookup_length(ns.id, tokens[:-1])
        return min(n, len(tokens) - 2), tier

    def lease_prefix(self, ns: Namespace, tokens: Sequence[int]) -> Lease | None:
        """Pin the longest cached prefix of ``tokens`` in ``ns`` (thread-safe): it survives
        eviction until ``lease.release()``. ``lease.data`` is the raw state, ``lease.tokens``
        the tokens it holds, ``lease.length`` how many of ``tokens`` it serves."""
        return self.store.acquire(ns.id, tokens)

    def _compile_grammar(self, text: str) -> _Grammar:
        with self._vocab_lock:
            if self._llama is None:
                raise EngineClosed("the engine is closed")
            return _Grammar(self._lib, self._vocab, self.n_vocab, text)

    def check_grammar(self, text: str) -> None:
        """Raise :class:`InvalidRequestError` if llama.cpp cannot compile the GBNF ``text``
        (thread-safe; what a request with that grammar would be refused for)."""
        self._compile_grammar(text).close()

    def load(self) -> EngineLoad:
        return EngineLoad(
            queue_depth=self._queue.qsize(),
            active=self._active,
            prefill_tps=self._prefill_tps,
            decode_tps=self._decode_tps,
        )

    def cache_usage(self) -> tuple[int, int]:
        """(capacity bytes, used bytes) over both tiers."""
        s = self.store.stats
        return s.ram_budget_bytes + s.disk_budget_bytes, s.ram_bytes + s.disk_bytes

    # ---------------------------------------------------------------- submitting

    def submit_chat(self, messages: object, ns: Namespace | None = None,
                    params: SamplingParams | None = None, *,
                    on_token: Callable[[TokenPiece], None] | None = None,
                    on_finish: Callable[[], None] | None = None) -> RequestHandle:
        rendered = self.render_chat(messages)
        return self._submit(rendered.tokens, ns, params, rendered.boundaries, on_token,
                            on_finish)

    def submit_tokens(self, tokens: Sequence[int], ns: Namespace | None = None,
                      params: SamplingParams | None = None, *,
                      boundaries: Sequence[int] = (),
                      on_token: Callable[[TokenPiece], None] | None = None,
                      on_finish: Callable[[], None] | None = None) -> RequestHandle:
        return self._submit(tuple(tokens), ns, params, tuple(boundaries), on_token, on_finish)

    def chat(self, messages: object, ns: Namespace | None = None,
             params: SamplingParams | None = None, timeout: float | None = None) -> Completion:
        return self.submit_chat(messages, ns, params).result(timeout)

    def complete_tokens(self, tokens: Sequence[int], ns: Namespace | None = None,
                        params: SamplingParams | None = None,
                        timeout: float | None = None) -> Completion:
        return self.submit_tokens(tokens, ns, params).result(timeout)

    def _submit(self, tokens: tuple[int, ...], ns: Namespace | None,
                params: SamplingParams | None, boundaries: tuple[int, ...],
                on_token: Callable[[TokenPiece], None] | None,
                on_finish: Callable[[], None] | None = None) -> RequestHandle:
        if self._closed or not self._worker.is_alive():
            raise EngineClosed("the engine is closed")
        params = params or SamplingParams()
        params.validate()
        ns = ns or self.default_namespace
        if not tokens:
            raise EmptyPromptError("the prompt has no tokens")
        n_vocab = self.n_vocab
        if any(not isinstance(t, int) or t < 0 or t >= n_vocab for t in tokens):
            raise InvalidRequestError(f"token ids must be integers in [0, {n_vocab})")
        if len(tokens) + params.max_tokens > self.n_ctx:
            raise ContextOverflowError(
                f"prompt of {len(tokens)} tokens + max_tokens {params.max_tokens} exceeds the "
                f"context of {self.n_ctx} tokens"
            )
        self.register_namespace(ns)
        handle = RequestHandle(next(self._ids), tokens, ns, params, boundaries, on_token,
                               on_finish)
        if params.grammar is not None:
            handle.grammar = self._compile_grammar(params.grammar)
        try:
            self._queue.put_nowait(handle)
        except queue.Full:
            if handle.grammar is not None:
                handle.grammar.close()
            raise EngineBusy(
                f"engine queue is full ({self.config.max_queue} requests waiting)"
            ) from None
        return handle

    # ---------------------------------------------------------------- lifecycle

    def close(self, *, flush: bool = True, timeout: float | None = None) -> None:
        """Stop the worker (queued requests are cancelled, the running one stops at its next
        token or prefill chunk) and the KV writer; with ``flush`` the states still queued for
        disk are written first (write-behind has written the rest already). Each wait is
        bounded by ``timeout`` (None: ``stop_timeout_s``)."""
        if timeout is None:
            timeout = self.config.stop_timeout_s
        if self._closed:
            return
        self._closed = True
        current = self._current
        if current is not None:
            current.cancel()  # stops at its next token
        for running in list(self._running):
            running.cancel()
        while True:  # cancel what is still queued
            try:
                h = self._queue.get_nowait()
            except queue.Empty:
                break
            if h is not None:
                h._finish(Completion([], "", "cancelled", RequestStats(finish_reason="cancelled")),
                          None)
        self._queue.put(None)
        self._worker.join(timeout)
        self.store.close(flush=flush, timeout=timeout)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- worker thread

    def _run(self) -> None:
        try:
            self._load_model()
        except BaseException as exc:  # noqa: BLE001 - reported to the constructor
            self._load_error = exc if isinstance(exc, EngineError) else ModelLoadError(
                f"llama.cpp could not load {self.model_path}: {exc}")
            self._loaded.set()
            return
        self._loaded.set()
        if self._batched:
            try:
                self._run_batched()
            finally:
                with self._vocab_lock:
                    llama, self._llama = self._llama, None
                if llama is not None:
                    with contextlib.suppress(Exception):
                        self._lib.llama_batch_free(self._mbatch)
                        llama.close()
            return
        try:
            while True:
                handle = self._queue.get()
                if handle is None:
                    break
                if handle.cancelled:
                    handle._finish(
                        Completion([], "", "cancelled", RequestStats(
                            prompt_tokens=len(handle.tokens), finish_reason="cancelled")), None)
                    continue
                self._active = 1
                self._current = handle
                try:
                    completion = self._serve(handle)
                except Exception as exc:
                    log.exception("request %d failed", handle.id)
                    handle._finish(None, exc)
                else:
                    handle._finish(completion, None)
                finally:
                    self._active = 0
                    self._current = None
        finally:
            # Tokenisation runs on callers' threads (read-only vocabulary, which llama.cpp
            # allows concurrently with decoding) but must not race with freeing the model.
            with self._vocab_lock:
                llama, self._llama = self._llama, None
            if llama is not None:
                with contextlib.suppress(Exception):
                    llama.close()

    def _load_model(self) -> None:
        import llama_cpp
        import llama_cpp.llama
        from llama_cpp import _internals
        from llama_cpp import llama_cpp as lib

        cfg = self.config
        with _load_lock:
            original = lib.llama_model_default_params
            original_ctx = lib.llama_context_default_params

            def params_without_repacking():
                p = original()
                p.use_extra_bufts = False  # batch-split-independent kernels (see docstring)
                return p

            def context_params_two_sequences():
                # Llama() exposes neither n_seq_max nor kv_unified
                p = original_ctx()
                p.n_seq_max = self._n_seq
                p.kv_unified = True
                return p

            lib.llama_model_default_params = params_without_repacking
            lib.llama_context_default_params = context_params_two_sequences
            # verbose=False silences llama.cpp by pointing the process's fds 1 and 2 (and
            # sys.stdout/err) at /dev/null for the whole load: from this thread, the node's
            # own log lines and prints of that moment vanished too (seen: a start's
            # warnings lost). llama.cpp logs through its callback, which verbose=False
            # already limits to errors: nothing else needs silencing (checked)
            suppress = llama_cpp.llama.suppress_stdout_stderr, _internals.suppress_stdout_stderr
            llama_cpp.llama.suppress_stdout_stderr = _internals.suppress_stdout_stderr = \
                _keep_stdio
            try:
                llama = llama_cpp.Llama(
                    model_path=str(self.model_path),
                    n_ctx=cfg.n_ctx,
                    n_batch=min(cfg.n_batch, cfg.n_ctx),
                    n_ubatch=min(cfg.n_batch, cfg.n_ctx),
                    n_threads=cfg.n_threads,
                    n_threads_batch=cfg.n_threads,
                    n_gpu_layers=cfg.n_gpu_layers,
                    flash_attn=cfg.flash_attn,
                    type_k=KV_TYPES[cfg.type_k],
                    type_v=KV_TYPES[cfg.type_v],
                    swa_full=True,  # sliding-window models: keep every cell (see below)
                    seed=cfg.seed,
                    logits_all=False,
                    verbose=False,
                )
            except ValueError as exc:
                raise ModelLoadError(f"llama.cpp could not load {self.model_path}: {exc}") from exc
            finally:
                lib.llama_model_default_params = original
                lib.llama_context_default_params = original_ctx
                llama_cpp.llama.suppress_stdout_stderr, _internals.suppress_stdout_stderr = \
                    suppress
        self._lib = lib
        self._llama = llama
        if cfg.n_gpu_layers != 0 or log.isEnabledFor(logging.DEBUG):
            from .gpu import describe, gpu_report

            log.info("accelerator: %s", describe(gpu_report()))
        self._ctx = llama._ctx.ctx
        self._mem = lib.llama_get_memory(self._ctx)
        self._vocab = llama._model.vocab
        self.n_vocab = llama.n_vocab()
        self.n_ctx = llama.n_ctx()
        # A sliding-window model's saved state may only be continued exactly where it ends,
        # never cut back to a shorter prefix (measured: wrong logits otherwise).
        self._can_truncate = not any(
            k.endswith(".attention.sliding_window") for k in self.gguf.metadata)
        meta = self.gguf.metadata
        bos_id = meta.get("tokenizer.ggml.bos_token_id")
        eos_id = meta.get("tokenizer.ggml.eos_token_id")

        def token_text(tid):
            if tid is None or not 0 <= tid < self.n_vocab:
                return ""
            return llama._model.token_get_text(tid)

        self._renderer = ChatRenderer(
            self.gguf.chat_template,
            lambda text: llama.tokenize(text.encode("utf-8"), add_bos=False, special=True),
            bos_token=token_text(bos_id),
            eos_token=token_text(eos_id),
            bos_token_id=bos_id,
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        )

    # -- llama helpers (worker thread only)

    def _decode(self, tokens: Sequence[int], n_past: int) -> None:
        llama = self._llama
        step = llama.n_batch
        for i in range(0, len(tokens), step):
            chunk = tokens[i : i + step]
            llama._batch.set_batch(batch=chunk, n_past=n_past + i, logits_all=False)
            rc = self._lib.llama_decode(self._ctx, llama._batch.batch)
            if rc != 0:
                raise EngineError(f"llama_decode failed with code {rc}")

    def _decode_body(self, tokens: Sequence[int], n_past: int, h: RequestHandle) -> bool:
        """Evaluate ``tokens`` in chunks of at most n_batch and (if possible) at least 2;
        False if the request was cancelled between chunks (the context is then partial)."""
        step = self._llama.n_batch
        i, n = 0, len(tokens)
        while i < n:
            if h.cancelled:
                return False
            size = min(step, n - i)
            if n - i - size == 1:  # never leave a lone token for the last chunk
                size -= 1
            self._decode(tokens[i : i + size], n_past + i)
            i += size
        return True

    def _logits(self) -> np.ndarray:
        ptr = self._lib.llama_get_logits_ith(self._ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def _snapshot(self, seq: int = 0) -> ctypes.Array:
        lib = self._lib
        size = lib.llama_state_seq_get_size(self._ctx, seq)
        buf = (ctypes.c_uint8 * size)()
        n = lib.llama_state_seq_get_data(self._ctx, buf, size, seq)
        if n != size:
            raise EngineError(f"llama_state_seq_get_data wrote {n} of {size} bytes")
        return buf

    def _segment_state(self, start: int, end: int, src: int = 0,
                       scratch: int = 1) -> ctypes.Array:
        """The state of sequence ``src``'s cells at positions [start, end) alone: they are
        labelled sequence ``scratch`` too, saved as that sequence, and unlabelled again."""
        lib, mem = self._lib, self._mem
        lib.llama_memory_seq_rm(mem, scratch, -1, -1)
        lib.llama_memory_seq_cp(mem, src, scratch, start, end)
        try:
            return self._snapshot(scratch)
        finally:
            lib.llama_memory_seq_rm(mem, scratch, -1, -1)

    @staticmethod
    def _as_buffer(data) -> ctypes.Array:
        if isinstance(data, ctypes.Array):
            return data
        if isinstance(data, bytearray):
            return (ctypes.c_uint8 * len(data)).from_buffer(data)
        return (ctypes.c_uint8 * len(data)).from_buffer_copy(data)

    def _restore(self, lease: Lease, length: int, seq: int = 0, scratch: int = 1,
                 clear: bool = True) -> bool:
        """Load ``lease``'s chain of states into sequence 0 and cut it to ``length`` tokens.

        The first state (a whole prefix) goes straight into sequence 0; each further
        segment (tokens [base, next base)) into the empty sequence 1, whose cells are then
        relabelled sequence 0 (``seq_cp`` + ``seq_rm``). Cells land in the order a cold
        prefill would put them, so greedy outputs stay bit-identical (tested)."""
        lib, mem = self._lib, self._mem

        def wipe():
            if clear:
                lib.llama_memory_clear(mem, _ZERO_KV_BUFFERS)
            else:
                lib.llama_memory_seq_rm(mem, seq, -1, -1)
                lib.llama_memory_seq_rm(mem, scratch, -1, -1)

        wipe()
        held = 0
        for i, (base, data) in enumerate(lease.segments):
            if base >= length:
                break  # the rest is past what this request uses
            buf = self._as_buffer(data)
            target = seq if i == 0 else scratch
            if lib.llama_state_seq_set_data(self._ctx, buf, len(buf), target) == 0:
                wipe()
                return False
            if target == scratch:
                lib.llama_memory_seq_cp(mem, scratch, seq, -1, -1)
                lib.llama_memory_seq_rm(mem, scratch, -1, -1)
            nxt = lease.segments[i + 1][0] if i + 1 < len(lease.segments) else None
            held = nxt if nxt is not None else lease.entry_tokens
        if held > length:
            if not lib.llama_memory_seq_rm(mem, seq, length, -1):
                wipe()
                return False
        return True

    def _sample(self, logits: np.ndarray, params: SamplingParams, rng) -> int:
        if params.temperature <= 0.0:
            return int(np.argmax(logits))
        x = logits.astype(np.float64) / params.temperature
        if params.top_k and params.top_k < x.size:
            idx = np.argpartition(-x, params.top_k - 1)[: params.top_k]
        else:
            idx = np.arange(x.size)
        order = idx[np.argsort(-x[idx], kind="stable")]
        p = np.exp(x[order] - x[order[0]])
        p /= p.sum()
        if params.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(p), params.top_p) + 1)
            order, p = order[:keep], p[:keep] / p[:keep].sum()
        return int(order[rng.choice(len(order), p=p)])

    def _choose(self, h: RequestHandle, logits: np.ndarray, rng) -> tuple[int, tuple]:
        """The next token of ``h`` (its grammar applied) and, when it asked for logprobs,
        ``(bytes, logprob, top)`` of it from the raw logits (else ``()``)."""
        grammar = h.grammar
        if grammar is None:
            tok = self._sample(logits, h.params, rng)
        else:
            # try the unconstrained choice first (one token checked instead of the whole
            # vocabulary); only if the grammar refuses it, sample from the masked logits.
            # For greedy decoding this is exactly the masked argmax; for sampling it is
            # the masked distribution (rejection), up to top-k/top-p truncation
            tok = self._sample(logits, h.params, rng)
            if not grammar.allows(tok):
                masked = grammar.mask(logits)
                if not np.isfinite(masked.max()):
                    raise EngineError("the grammar allows no next token")
                tok = self._sample(masked, h.params, rng)
            if not self._lib.llama_vocab_is_eog(self._vocab, tok):
                grammar.accept(tok)
        if h.params.logprobs is None:
            return tok, ()
        return tok, _logprobs(logits, tok, h.params.logprobs, self._token_bytes)

    def _token_bytes(self, tok: int) -> bytes:
        return self._llama.detokenize([tok])

    def _serve(self, h: RequestHandle) -> Completion:
        lib = self._lib
        stats = h.stats = RequestStats(prompt_tokens=len(h.tokens))
        t_start = time.perf_counter()
        stats.queue_wait_s = t_start - h.submitted_at
        tokens = h.tokens
        n_prompt = len(tokens)
        ns_id = h.ns.id

        # Batch discipline (what makes cached runs bit-identical to cold ones): the CPU
        # kernels give slightly different results for a batch of ONE token than for the
        # same token inside a larger batch (and the same results for any batch of >= 2).
        # So every request evaluates its prompt, the last token included, in chunks of
        # >= 2 tokens (one pass over the weights for a short new suffix); a restore or a
        # live prefix leaves at least 2 prompt tokens to evaluate; snapshots hold body
        # prefixes tokens[:T] (T <= P - 1), so generated tokens (computed alone) are never
        # part of one. Only a 1-token prompt is evaluated alone, cold and warm alike.
        body_end = n_prompt - 1
        reuse_limit = max(0, n_prompt - 2)  # most prompt tokens a request does not evaluate

        # 1-2: keep what the previous request left live in sequence 0 when it serves at
        # least as much as the store would, else restore the longest cached prefix
        live = self._live_use(ns_id, tokens, reuse_limit)
        self._live = None  # the context changes from here on
        n_past = 0
        if reuse_limit >= 1:
            lease = self.store.acquire(ns_id, tokens[:body_end])
            if live and (lease is None or live >= min(lease.length, reuse_limit)):
                if lease is not None:
                    lease.release()
                    lease = None
                if lib.llama_memory_seq_rm(self._mem, 0, live, -1):
                    n_past = live
                    stats.hit_tier = "live"
            if n_past == 0:
                lib.llama_memory_clear(self._mem, _ZERO_KV_BUFFERS)
            if lease is not None:
                try:
                    use = min(lease.length, reuse_limit)
                    t0 = time.perf_counter()
                    if use <= 0 or (use < lease.entry_tokens and not self._can_truncate):
                        pass  # nothing usable: run cold
                    elif self._restore(lease, use):
                        n_past = use
                        stats.hit_tier = lease.tier
                    else:
                        log.warning("llama refused a stored state; dropping it and running cold")
                        lease.release()
                        with contextlib.suppress(Exception):
                            self.store.remove(ns_id, lease.tokens)
                    stats.restore_s = time.perf_counter() - t0
                finally:
                    lease.release()
        elif n_prompt >= 1:
            lib.llama_memory_clear(self._mem, _ZERO_KV_BUFFERS)
        stats.cached_tokens = n_past

        # 3: evaluate the rest of the prompt, stopping at snapshot points
        stops = [n_prompt]
        if self.config.snapshot_policy == "boundaries":
            prev = n_past
            inner = []
            for b in sorted(h.boundaries):
                # at least min_snapshot_tokens long and that far from the previous stop and
                # from the body's end (closer points would mostly duplicate bytes)
                gap = self.config.min_snapshot_tokens
                if b >= gap and b - prev >= max(2, gap) and body_end - b >= max(2, gap):
                    inner.append(b)
                    prev = b
            stops = inner + stops
        t0 = time.perf_counter()
        reached: list[int] = []  # snapshot points whose whole prefix is now in the context
        for stop in stops:
            if not self._decode_body(tokens[n_past:stop], n_past, h):
                break
            n_past = stop
            if stop == n_prompt:
                if body_end >= 1:
                    reached.append(body_end)
            elif stop >= self.config.min_snapshot_tokens:
                reached.append(stop)
        if n_past == n_prompt and self.config.live_sequence and n_prompt >= 2:
            # the prompt's cells were all computed in chunks: the next request may go on
            # from them (generated tokens were computed alone and are cut off then)
            self._live = (ns_id, tuple(tokens))
        stats.prefill_s = time.perf_counter() - t0
        stats.prefill_tokens = n_prompt - stats.cached_tokens
        if h.cancelled:
            self._save_snapshots(ns_id, tokens, reached, stats)
            stats.finish_reason = "cancelled"
            stats.total_s = time.perf_counter() - t_start
            return Completion([], "", "cancelled", stats)
        if stats.prefill_tokens >= _MIN_PREFILL_FOR_RATE and stats.prefill_s > 0:
            self._prefill_tps = _ewma(self._prefill_tps, stats.prefill_tokens / stats.prefill_s)

        # 4: sample and stream
        params = h.params
        rng = np.random.default_rng(params.seed) if params.temperature > 0 else None
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        generated: list[int] = []
        text_parts: list[str] = []
        finish = "length"
        t_first = None
        end = None
        while True:
            tok, info = self._choose(h, self._logits(), rng)
            if t_first is None:
                t_first = time.perf_counter()
                stats.ttft_s = t_first - t_start
            if lib.llama_vocab_is_eog(self._vocab, tok):
                finish = "stop"
                end = TokenPiece(tok, "", *info)
                break
            generated.append(tok)
            data = self._llama.detokenize([tok])
            piece = decoder.decode(data)
            text_parts.append(piece)
            h._emit(TokenPiece(tok, piece, *info) if info else TokenPiece(tok, piece))
            if len(generated) >= params.max_tokens:
                finish = "length"
                break
            if h.cancelled:
                finish = "cancelled"
                break
            self._decode([tok], n_past)
            n_past += 1
        tail = decoder.decode(b"", final=True)
        if tail:
            text_parts.append(tail)
        t_end = time.perf_counter()
        stats.completion_tokens = len(generated)
        stats.decode_s = t_end - (t_first or t_end)
        if len(generated) > 1 and stats.decode_s > 0:
            stats.decode_tps = (len(generated) - 1) / stats.decode_s
            self._decode_tps = _ewma(self._decode_tps, stats.decode_tps)
        # 5: snapshots, off the time-to-first-token path
        self._save_snapshots(ns_id, tokens, reached, stats)
        stats.total_s = time.perf_counter() - t_start
        stats.finish_reason = finish
        return Completion(generated, "".join(text_parts), finish, stats, end)

    def _save_snapshots(self, ns_id: bytes, tokens: Sequence[int], points: list[int],
                        stats: RequestStats, src: int = 0, scratch: int = 1,
                        rebase_ok: bool = True) -> None:
        """Save each snapshot point as a segment on the longest stored prefix of it.

        Taken after generation, so it costs no time to first token; the context's cells of
        a body prefix are exactly what the prefill computed (generation only appends).
        Prefix sharing: a point's state holds only the tokens past the longest stored prefix
        of it (:meth:`KVStore.parent_length`). When the prompt diverged from a stored state
        at L tokens (it was served from that state cut back to L), L becomes a stored prefix
        of its own (the *branch point*) and, after the snapshots, the other state is rebased
        onto it (:meth:`_rebase`), so the shared L tokens end up stored once.
        """
        t0 = time.perf_counter()
        store, min_share = self.store, self.config.min_snapshot_tokens
        # decide before saving: this request's own snapshots must not make its other points
        # look covered; parents (shorter points) are saved first
        todo = [p for p in sorted(points) if not store.covered(ns_id, tokens[:p])]
        rebase = None
        for point in todo:
            prefix = tokens[:point]
            base = store.parent_length(ns_id, prefix)
            split, other, other_base = store.branch_point(ns_id, prefix)
            if other is not None and split - base >= min_share and other_base <= base:
                if store.put(ns_id, prefix[:split], self._segment_state(base, split, src, scratch),
                             base=base):
                    stats.snapshots_saved += 1
                    if other_base == base:
                        rebase = (other, split)
                    base = split
            if store.put(ns_id, prefix, self._segment_state(base, point, src, scratch),
                         base=base):
                stats.snapshots_saved += 1
        if rebase is not None and rebase_ok:
            self._rebase(ns_id, *rebase)
        stats.snapshot_s = time.perf_counter() - t0

    def _live_use(self, ns_id: bytes, tokens: Sequence[int], limit: int) -> int:
        """How many leading prompt tokens the live sequence serves (0: none), at most
        ``limit`` (the batch rules leave at least 2 prompt tokens to evaluate)."""
        if self._live is None or self._live[0] != ns_id:
            return 0
        held = self._live[1]
        n = _common_prefix(held, tokens, limit)
        if n < len(held) and not self._can_truncate:
            return 0
        return max(n, 0)

    def _rebase(self, ns_id: bytes, tokens: tuple[int, ...], split: int) -> None:
        """Replace the stored state of ``tokens`` by its segment past ``split`` (now a stored
        prefix): restore it whole (the request is done with the context), save [split, end)."""
        self._live = None  # the context is reused below
        lease = self.store.acquire(ns_id, tokens)
        if lease is None:
            return
        try:
            if lease.entry_tokens != len(tokens) or not self._restore(lease, len(tokens)):
                return
            self.store.rebase(ns_id, tokens, split, self._segment_state(split, len(tokens)))
        finally:
            lease.release()
            self._lib.llama_memory_clear(self._mem, _ZERO_KV_BUFFERS)


    # ---------------------------------------------------------------- throughput mode

    def _run_batched(self) -> None:
        """Continuous batching (``batch_mode="throughput"``), on the worker thread.

        Up to ``max_batch`` requests hold a sequence each (ids 0..max_batch-1; max_batch is
        scratch for segment states). Every step builds ONE ``llama_decode`` batch: the next
        token of every decoding sequence plus as many prompt tokens of prefilling sequences
        as fit in n_batch; a request that arrives meanwhile is admitted before the next
        step. A new request whose prompt shares a longer prefix with a running request than
        the store holds copies those cells (``llama_memory_seq_cp``: one computation, shared
        cells); if that request is still prefilling, the newcomer waits for it.

        A finished request's prompt cells stay resident in its sequence (``self._idle``,
        least recently used first) until the sequence or its cells are needed: a later
        request sharing a prefix with them copies the cells (``hit_tier`` "live", nothing
        restored), as llama-server's slots keep their prompts."""
        lib = self._lib
        n_slots = self.config.max_batch
        self._scratch = n_slots
        self._mbatch = lib.llama_batch_init(self._llama.n_batch, 0, 1)
        free = list(range(n_slots))
        self._idle = {}
        self._cells = CellLedger()  # what the KV cache holds, shared cells once
        admit_held = False  # the KV cache was full: admit nothing until a request ends
        slots: list[_Slot] = []
        pending: list[RequestHandle] = []
        stopping = False
        while True:
            items = []
            if not slots and not pending:
                items.append(self._queue.get())
            # take from the queue only what free sequences can start: the rest stays queued
            # (bounded by max_queue, so a full engine still answers EngineBusy)
            while len(pending) + len(items) < len(free) + len(self._idle):
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            for handle in items:
                if handle is None:
                    stopping = True
                else:
                    pending.append(handle)
            if stopping:
                for handle in pending:
                    handle._finish(Completion([], "", "cancelled", RequestStats(
                        prompt_tokens=len(handle.tokens), finish_reason="cancelled",
                        batch_mode="throughput")), None)
                for slot in slots:
                    slot.h.cancel()
                    self._retire(slot, "cancelled")
                return
            # admit while sequences and KV cells last
            while pending and (free or self._idle) and not admit_held:
                h = pending[0]
                if h.cancelled:
                    pending.pop(0)
                    h._finish(Completion([], "", "cancelled", RequestStats(
                        prompt_tokens=len(h.tokens), finish_reason="cancelled",
                        batch_mode="throughput")), None)
                    continue
                shared = max((_common_prefix(s.h.tokens, h.tokens, len(h.tokens) - 1)
                              for s in slots if s.h.ns.id == h.ns.id), default=0)
                need = len(h.tokens) + h.params.max_tokens - shared
                while self._idle and self._kv_demand(slots) + need > self.n_ctx:
                    self._drop_idle(next(iter(self._idle)), free)  # least recently used
                if slots and self._kv_demand(slots) + need > self.n_ctx:
                    break  # waits for cells (a copied shared prefix costs none)
                pending.pop(0)
                if not free:  # every sequence is resident: give up the least useful one
                    self._drop_idle(self._idle_victim(h), free)
                seq = free.pop(0)
                try:
                    slot = self._admit(h, seq, slots)
                except Exception as exc:
                    log.exception("request %d failed", h.id)
                    self._free_sequence(seq, free)
                    h._finish(None, exc)
                    continue
                if slots and self._kv_demand([*slots, slot]) > self.n_ctx:
                    # placed, it takes more cells than estimated (restored where a copy
                    # was counted, or no room to restore): it waits for a request to end
                    self._free_sequence(seq, free)
                    pending.insert(0, h)
                    admit_held = True
                    break
                slots.append(slot)
                self._running.add(h)
            self._active = len(slots)
            if not slots:
                continue
            try:
                self._step(slots)
            except _KvFull:
                admit_held = self._make_room(slots, pending, free)
                continue
            except Exception as exc:
                log.exception("batched decode failed")
                for slot in slots:
                    slot.error = exc
                    slot.finish = "error"
            for slot in [s for s in slots if s.finish]:
                slots.remove(slot)
                admit_held = False  # cells were given back
                if self._retire(slot, slot.finish):
                    src = slot.resident_source
                    if src in self._idle and 2 * slot.stats.cached_tokens >= len(
                            self._idle[src][1]):
                        # superseded: this sequence now holds (shares) at least half of the
                        # cells the resident it copied from held, and is more recent (else
                        # one prefix cycled with new suffixes fills every resident slot)
                        self._drop_idle(src, free)
                    while len(self._idle) >= self._resident_max:
                        self._drop_idle(next(iter(self._idle)), free)  # least recently used
                    self._idle[slot.seq] = (slot.h.ns.id, slot.h.tokens)
                else:
                    free.append(slot.seq)  # _retire emptied it
                    free.sort()
            self._active = len(slots)

    def _kv_demand(self, slots: list[_Slot]) -> int:
        """KV cells held now plus those the running requests may still add (their prompt
        not yet evaluated, their tokens not yet generated)."""
        grow = 0
        for s in slots:
            if s.phase == "wait":  # will copy s.shared cells from its source, then grow
                grow += len(s.h.tokens) - s.shared + s.h.params.max_tokens
            else:
                # decoding, n_past counts generated tokens too; each generated token but
                # the last is evaluated once
                grow += (max(0, len(s.h.tokens) - s.n_past)
                         + max(0, s.h.params.max_tokens - len(s.generated)))
        return self._cells.used() + grow

    def _make_room(self, slots: list[_Slot], pending: list[RequestHandle],
                   free: list[int]) -> bool:
        """``llama_decode`` found no free cells (the admission estimate was short, e.g. a
        waiting request's source ended before the copy). Give up resident sequences first;
        else put the most recently admitted request that has produced nothing back at the
        head of the queue (it starts again later, nobody sees a difference); else end the
        most recent one with an error, never all of them. True: admit nothing until a
        running request ends."""
        if self._idle:
            for seq in list(self._idle):
                self._drop_idle(seq, free)
            return True
        live = [s for s in slots if not s.finish]
        quiet = [s for s in live if s.t_first == 0.0]
        if len(live) > 1 and quiet:
            victim = max(quiet, key=lambda s: s.t_start)
            slots.remove(victim)
            self._running.discard(victim.h)
            self._free_sequence(victim.seq, free)
            pending.insert(0, victim.h)
            self.batch_counters["preempted"] += 1
            log.info("KV cache full (%d cells in use of %d): request %d waits for room",
                     self._cells.used(), self.n_ctx, victim.h.id)
            return True
        victim = max(live, key=lambda s: s.t_start)
        victim.error = EngineError(
            f"the KV cache is full ({self._cells.used()} of n_ctx {self.n_ctx} cells in use "
            "by the requests running with this one): retry, or raise [model] n_ctx")
        victim.finish = "error"
        return True

    def _idle_victim(self, h: RequestHandle) -> int:
        """The resident sequence whose cells serve ``h`` least (least recently used first)."""
        return min(self._idle, key=lambda seq: (
            _common_prefix(self._idle[seq][1], h.tokens, len(h.tokens) - 1)
            if self._idle[seq][0] == h.ns.id else 0))

    def _drop_idle(self, seq: int, free: list[int]) -> None:
        del self._idle[seq]
        self._free_sequence(seq, free)

    def _free_sequence(self, seq: int, free: list[int]) -> None:
        self._cut_cells(seq)
        free.append(seq)
        free.sort()

    # throughput mode changes its sequences' cells only through these two, so the ledger
    # (admission's count of cells in use) always mirrors the cache

    def _cut_cells(self, seq: int, keep: int = 0) -> None:
        """``seq`` keeps its first ``keep`` positions (0: none)."""
        self._lib.llama_memory_seq_rm(self._mem, seq, keep or -1, -1)
        self._cells.truncate(seq, keep)

    def _copy_cells(self, src: int, dst: int, k: int) -> None:
        """The empty ``dst`` holds ``src``'s first ``k`` positions: the same cells."""
        self._lib.llama_memory_seq_cp(self._mem, src, dst, 0, k)
        self._cells.copy(src, dst, k)

    def _admit(self, h: RequestHandle, seq: int, slots: list[_Slot]) -> _Slot:
        slot = _Slot(h, seq)
        slot.stats = h.stats = RequestStats(prompt_tokens=len(h.tokens), batch_mode="throughput")
        slot.t_start = time.perf_counter()
        slot.stats.queue_wait_s = slot.t_start - h.submitted_at
        if h.params.temperature > 0:
            slot.rng = np.random.default_rng(h.params.seed)
        slot.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._place(slot, slots)
        return slot

    def _place(self, slot: _Slot, slots: list[_Slot]) -> None:
        """Give ``slot`` its prefix: cells copied from a running sequence (or wait for them),
        else a restore from the store, else nothing (cold)."""
        h = slot.h
        tokens, body_end = h.tokens, len(h.tokens) - 1
        self._cut_cells(slot.seq)
        slot.n_past = 0
        if body_end < 1:
            slot.phase = "prefill"
            return
        lease = self.store.acquire(h.ns.id, tokens[:body_end])
        stored = lease.length if lease is not None else 0
        best, best_len = None, 0
        resident, resident_len = None, 0
        if self._can_truncate:
            for other in slots:
                if other is slot or other.phase == "wait" or other.h.ns.id != h.ns.id:
                    continue
                n = _common_prefix(other.h.tokens, tokens, body_end)
                if n > best_len:
                    best, best_len = other, n
            for seq, (ns_id, held) in self._idle.items():
                n = _common_prefix(held, tokens, body_end) if ns_id == h.ns.id else 0
                if n > resident_len:
                    resident, resident_len = seq, n
        margin = _COPY_OVER_RESTORE_TOKENS
        if resident is not None and resident_len >= best_len and resident_len + margin >= stored:
            # a finished request's cells: copy them (shared cells, nothing restored)
            if lease is not None:
                lease.release()
            self._copy_cells(resident, slot.seq, resident_len)
            self._idle[resident] = self._idle.pop(resident)  # most recently used
            slot.resident_source = resident
            slot.n_past = slot.stats.cached_tokens = resident_len
            slot.stats.hit_tier = "live"
            slot.phase = "prefill"
            return
        if best is not None and best_len + margin >= stored and (
                best_len > stored or best.n_past >= best_len):
            if lease is not None:
                lease.release()
            slot.source, slot.shared = best, best_len
            slot.phase = "wait"
            self._try_copy(slot)
            return
        slot.phase = "prefill"
        if lease is None:
            return
        try:
            t0 = time.perf_counter()
            use = lease.length
            if use > 0 and (use == lease.entry_tokens or self._can_truncate):
                if self._restore(lease, use, slot.seq, self._scratch, clear=False):
                    self._cells.append(slot.seq, use)
                    slot.n_past = use
                    slot.stats.hit_tier = lease.tier
                elif self._cells.used():
                    # other sequences hold cells: too few left for the state, which is
                    # fine; the prompt is computed instead (the safety net makes room)
                    log.info("no KV room to restore %d cached tokens: computing them", use)
                else:
                    log.warning("llama refused a stored state; dropping it and running cold")
                    with contextlib.suppress(Exception):
                        self.store.remove(h.ns.id, lease.tokens)
            slot.stats.restore_s = time.perf_counter() - t0
        finally:
            lease.release()
        slot.stats.cached_tokens = slot.n_past

    def _try_copy(self, slot: _Slot) -> None:
        """A waiting slot takes its shared prefix once its source has computed it."""
        src = slot.source
        if src.n_past >= slot.shared and src.phase != "wait":
            self._copy_cells(src.seq, slot.seq, slot.shared)
            slot.n_past = slot.shared
            slot.stats.cached_tokens = slot.shared
            slot.stats.hit_tier = "live"
            slot.phase = "prefill"
            slot.source = None

    def _step(self, slots: list[_Slot]) -> None:
        lib, b = self._lib, self._mbatch
        for slot in slots:
            if slot.h.cancelled and not slot.finish:
                slot.finish = "cancelled"
            elif slot.phase == "wait":
                if slot.source.finish or slot.source not in slots:
                    self._place(slot, [s for s in slots if not s.finish])  # source gone
                else:
                    self._try_copy(slot)
        budget = self._llama.n_batch
        n = 0
        parts: list[tuple[_Slot, int, int]] = []  # (slot, tokens added, index of logits or -1)
        for slot in slots:  # one token for every decoding sequence first
            if slot.finish or slot.phase != "decode":
                continue
            b.token[n], b.pos[n], b.n_seq_id[n] = slot.next_tok, slot.n_past, 1
            b.seq_id[n][0], b.logits[n] = slot.seq, 1
            parts.append((slot, 1, n))
            n += 1
        n_decoding = n
        if n_decoding:
            budget = min(budget, n_decoding + _PREFILL_TOKENS_WHILE_DECODING)
        for slot in slots:
            if slot.finish or slot.phase != "prefill" or n >= budget:
                continue
            tokens = slot.h.tokens
            take = min(budget - n, len(tokens) - slot.n_past)
            if slot.t_prefill == 0.0:
                slot.t_prefill = time.perf_counter()
            for j in range(take):
                pos = slot.n_past + j
                b.token[n], b.pos[n], b.n_seq_id[n] = tokens[pos], pos, 1
                b.seq_id[n][0] = slot.seq
                b.logits[n] = 1 if pos == len(tokens) - 1 else 0
                n += 1
            parts.append((slot, take, n - 1 if slot.n_past + take == len(tokens) else -1))
        if n == 0:
            return
        b.n_tokens = n
        rc = lib.llama_decode(self._ctx, b)
        if rc == 1:
            raise _KvFull()
        if rc != 0:
            raise EngineError(f"llama_decode failed with code {rc} ({n} tokens)")
        n_seqs = len(parts)
        counters = self.batch_counters
        if n_decoding:
            counters["max_prefill_while_decoding"] = max(
                counters["max_prefill_while_decoding"], n - n_decoding)
        counters["steps"] += 1
        counters["sequences"] += n_seqs
        counters["tokens"] += n
        now = time.perf_counter()
        for slot, added, idx in parts:
            slot.n_past += added
            self._cells.append(slot.seq, added)
            slot.stats.max_batch_seen = max(slot.stats.max_batch_seen, n_seqs)
            if idx < 0:
                continue
            if slot.phase == "prefill":
                slot.phase = "decode"
                slot.stats.prefill_s = now - slot.t_prefill
                slot.stats.prefill_tokens = len(slot.h.tokens) - slot.stats.cached_tokens
            ptr = lib.llama_get_logits_ith(self._ctx, idx)
            logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
            tok, info = self._choose(slot.h, logits, slot.rng)
            if slot.t_first == 0.0:
                slot.t_first = time.perf_counter()
                slot.stats.ttft_s = slot.t_first - slot.t_start
            if lib.llama_vocab_is_eog(self._vocab, tok):
                slot.finish = "stop"
                slot.end = TokenPiece(tok, "", *info)
                continue
            slot.generated.append(tok)
            data = self._llama.detokenize([tok])
            piece = slot.decoder.decode(data)
            slot.text_parts.append(piece)
            slot.h._emit(TokenPiece(tok, piece, *info) if info else TokenPiece(tok, piece))
            if len(slot.generated) >= slot.h.params.max_tokens:
                slot.finish = "length"
            elif slot.h.cancelled:
                slot.finish = "cancelled"
            else:
                slot.next_tok = tok

    def _retire(self, slot: _Slot, finish: str) -> bool:
        """Finish ``slot``'s request: save its body (a segment on the longest stored prefix;
        no rebase, other sequences hold the context). True: its sequence keeps the prompt's
        cells (resident for later requests); False: the sequence is empty again."""
        stats, h = slot.stats, slot.h
        self._running.discard(h)
        keep = False
        try:
            body_end = len(h.tokens) - 1
            if (slot.phase == "decode" and body_end >= self.config.min_snapshot_tokens
                    and body_end > stats.cached_tokens and finish != "error"):
                self._save_snapshots(h.ns.id, h.tokens, [body_end], stats, src=slot.seq,
                                     scratch=self._scratch, rebase_ok=False)
            # the prompt's cells were all computed in prefill chunks; generated ones go
            keep = (slot.phase == "decode" and finish != "error" and body_end >= 1
                    and self._can_truncate)
        except Exception:
            log.exception("saving the snapshot of request %d failed", h.id)
        finally:
            self._cut_cells(slot.seq, len(h.tokens) if keep else 0)
        if slot.error is not None:
            h._finish(None, slot.error)
            return keep
        tail = slot.decoder.decode(b"", final=True)
        if tail:
            slot.text_parts.append(tail)
        t_end = time.perf_counter()
        stats.completion_tokens = len(slot.generated)
        stats.decode_s = t_end - (slot.t_first or t_end)
        if len(slot.generated) > 1 and stats.decode_s > 0:
            stats.decode_tps = (len(slot.generated) - 1) / stats.decode_s
            self._decode_tps = _ewma(self._decode_tps, stats.decode_tps)
        if stats.prefill_tokens >= _MIN_PREFILL_FOR_RATE and stats.prefill_s > 0:
            self._prefill_tps = _ewma(self._prefill_tps, stats.prefill_tokens / stats.prefill_s)
        stats.total_s = t_end - slot.t_start
        stats.finish_reason = finish
        h._finish(Completion(slot.generated, "".join(slot.text_parts), finish, stats,
                             slot.end), None)
        return keep


class _Grammar:
    """A compiled llama.cpp GBNF grammar sampler for one request (its parse state advances
    with :meth:`accept`). Made on the submitting thread (llama.cpp only reads the
    vocabulary), used on the worker thread, freed when the request finishes."""

    _DTYPE = np.dtype([("id", np.intc), ("logit", np.single), ("p", np.single)], align=True)

    def __init__(self, lib, vocab, n_vocab: int, text: str) -> None:
        self._lib = lib
        if "\x00" in text:
            raise InvalidRequestError("the grammar contains a NUL character")
        self._ptr = lib.llama_sampler_init_grammar(vocab, text.encode("utf-8"), b"root")
        if not self._ptr:
            raise InvalidRequestError("llama.cpp cannot parse the grammar (GBNF with a 'root' "
                                      "rule expected; see the node's log for the position)")
        self._data = np.zeros(n_vocab, dtype=self._DTYPE)
        self._ids = np.arange(n_vocab, dtype=np.intc)
        self._arr = lib.llama_token_data_array(
            data=self._data.ctypes.data_as(lib.llama_token_data_p), size=n_vocab, selected=-1,
            sorted=False)
        self._one = np.zeros(1, dtype=self._DTYPE)
        self._arr1 = lib.llama_token_data_array(
            data=self._one.ctypes.data_as(lib.llama_token_data_p), size=1, selected=-1,
            sorted=False)

    def allows(self, tok: int) -> bool:
        self._one["id"], self._one["logit"] = tok, 0.0
        self._arr1.size, self._arr1.selected, self._arr1.sorted = 1, -1, False
        self._lib.llama_sampler_apply(self._ptr, ctypes.byref(self._arr1))
        return bool(np.isfinite(self._one["logit"][0]))

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` with every token the grammar refuses now set to -inf (a copy)."""
        d = self._data
        d["id"], d["logit"], d["p"] = self._ids, logits, 0.0
        self._arr.size, self._arr.selected, self._arr.sorted = len(d), -1, False
        self._lib.llama_sampler_apply(self._ptr, ctypes.byref(self._arr))
        return d["logit"].copy()

    def accept(self, tok: int) -> None:
        self._lib.llama_sampler_accept(self._ptr, tok)

    def close(self) -> None:
        ptr, self._ptr = self._ptr, None
        if ptr:
            self._lib.llama_sampler_free(ptr)


def _logprobs(logits: np.ndarray, tok: int, n_top: int, token_bytes
              ) -> tuple[bytes, float, tuple[tuple[bytes, float], ...]]:
    """(bytes of ``tok``, its log-softmax of ``logits``, the ``n_top`` most likely tokens
    as (bytes, logprob), most likely first, ties by token id)."""
    x = logits.astype(np.float64)
    m = float(x.max())
    lse = m + float(np.log(np.exp(x - m).sum()))
    top: tuple[tuple[bytes, float], ...] = ()
    if n_top:
        idx = np.argpartition(-x, n_top - 1)[:n_top]
        idx = idx[np.lexsort((idx, -x[idx]))]
        top = tuple((token_bytes(int(i)), float(x[i] - lse)) for i in idx)
    return token_bytes(tok), float(x[tok] - lse), top


class _Slot:
    """A request holding a sequence in throughput mode (worker thread only)."""

    def __init__(self, h: RequestHandle, seq: int) -> None:
        self.h, self.seq = h, seq
        self.stats = RequestStats()
        self.phase = "prefill"  # "wait" (for a running sequence's prefix) | "prefill" | "decode"
        self.n_past = 0
        self.source: _Slot | None = None
        self.shared = 0
        self.resident_source: int | None = None  # the resident sequence its prefix came from
        self.next_tok = 0
        self.generated: list[int] = []
        self.text_parts: list[str] = []
        self.decoder = None
        self.rng = None
        self.t_start = self.t_prefill = self.t_first = 0.0
        self.finish = ""
        self.end: TokenPiece | None = None
        self.error: BaseException | None = None


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = 0
    for x, y in zip(a[:limit], b[:limit], strict=False):
        if x != y:
            break
        n += 1
    return n


def _ewma(old: float, new: float) -> float:
    return new if old == 0.0 else (1 - _EWMA_ALPHA) * old + _EWMA_ALPHA * new

