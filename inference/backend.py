"""The node's view of an inference engine: a small async ``Backend`` protocol.

The overlay (routing, forwarding, digests) needs five things from an engine: turn chat
messages into prompt token ids, say how long a prefix of a prompt it holds in a
namespace, stream a generation, report its load, and report which prefixes entered or
left its cache. :class:`Backend` is exactly that, so the overlay can be tested and
benchmarked with :class:`SimulatedBackend` (a deterministic model of an engine: a radix
tree of cached prompts, prefill/decode timed at configured rates, no model) and run for
real with :class:`LlamaBackend` (the llama.cpp engine of ``inference/engine.py``).

Threading (LlamaBackend): llama.cpp must only ever be called from one thread. The engine
owns a single worker thread; every call from trio goes through
``trio.to_thread.run_sync`` into the engine API (which queues to its worker), except
short-prompt tokenization (inline: it only reads the vocabulary) and submitting (a queue
put); streamed tokens come back through a trio memory channel that the engine's worker
feeds with ``TrioToken.run_sync_soon`` (one wake-up per token). Cancelling the consuming
trio task cancels the engine request.

Cache events are *polled* (:meth:`Backend.drain_cache_events`): the engine appends to a
thread-safe deque, the daemon drains it every digest tick. No cross-thread callbacks.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import trio

from prefixmesh.inference.core.blocks import chain_hashes
from prefixmesh.inference.core.radix import RadixTree

__all__ = [
    "BackendError",
    "BackendOverloaded",
    "BackendInvalidRequest",
    "GenerateRequest",
    "TokenChunk",
    "Completion",
    "CacheEvent",
    "BackendLoad",
    "Backend",
    "SimulatedBackend",
    "LlamaBackend",
    "ns_pseudo_token",
]


class BackendError(Exception):
    """The engine failed a request (message says why)."""


class BackendOverloaded(BackendError):
    """The engine's queue is full."""


class BackendInvalidRequest(BackendError):
    """The request cannot be run as asked (e.g. a grammar llama.cpp cannot compile)."""


@dataclass(frozen=True)
class GenerateRequest:
    ns: bytes  # namespace id (8 bytes)
    tokens: tuple[int, ...]  # prompt token ids, rendered and tokenized once
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    deadline: float = math.inf  # absolute Unix seconds
    grammar: str = ""  # llama.cpp GBNF the output must follow ("" = unconstrained)
    logprobs: int = -1  # -1: none; else each token's logprob and that many alternatives


@dataclass(frozen=True)
class TokenLogprob:
    piece: bytes  # the token's bytes
    logprob: float
    top: tuple[tuple[bytes, float], ...] = ()  # most likely first


@dataclass(frozen=True)
class TokenChunk:
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when asked for
    # on a generation's first chunk: the prompt tokens whose KV came from the cache, as the
    # engine decided before prefill (-1: not said; the Completion's figure is the same),
    # so a consumer that stops before the Completion still knows it
    cached_tokens: int = -1


@dataclass(frozen=True)
class Completion:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    total_s: float
    finish_reason: str  # "stop" | "length"
    batched: bool = False  # decoded in a shared batch (engine batch_mode "throughput")
    # with logprobs, finish "stop": the end-of-sequence token's entry (not in the text)
    end_logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class CacheEvent:
    kind: str  # "add" | "remove"
    ns: bytes  # namespace id
    chain: tuple[bytes, ...]  # chained block hashes of the prefix under the namespace key


@dataclass(frozen=True)
class BackendLoad:
    queue_depth: int  # requests waiting
    active: int  # requests running
    prefill_tps: float
    decode_tps: float
    kv_capacity_bytes: int
    kv_used_bytes: int
    avg_request_s: float  # recent mean service time of one request (queue-wait estimates)
    prefill_measured: bool = True  # False: prefill_tps is a default, not a measurement


@runtime_checkable
class Backend(Protocol):
    model_fingerprint: bytes
    # time.monotonic() when the load began (begin_load, or load itself), None before
    load_began: float | None

    def begin_load(self) -> None:
        """Start loading without waiting (the node's launcher: ``node/launch.py``)."""

    async def load(self) -> None:
        """Load, or wait for the load :meth:`begin_load` started; raises what it raised."""

    async def aclose(self) -> None: ...

    def register_namespace(self, name: str, key: bytes, ns_id: bytes) -> None: ...

    async def tokenize(self, messages: Sequence[tuple[str, str]]) -> tuple[int, ...]: ...

    async def tokenize_text(self, text: str) -> tuple[int, ...]: ...

    async def match_length(self, ns: bytes, tokens: Sequence[int]) -> int: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk | Completion]: ...

    def load_figures(self) -> BackendLoad: ...

    def drain_cache_events(self) -> list[CacheEvent]: ...


def ns_pseudo_token(ns: bytes) -> int:
    """A negative int standing for a namespace at the root of a shared radix tree
    (disjoint from real token ids by construction; see ARCHITECTURE.md, radix)."""
    return -1 - int.from_bytes(ns[:7].ljust(7, b"\0"), "big")


def _end_logprob(end) -> TokenLogprob | None:
    """The engine's end-of-generation piece as a :class:`TokenLogprob` (None without one
    or without logprobs)."""
    if end is None or end.logprob is None:
        return None
    return TokenLogprob(end.data, end.logprob, end.top)


_WORDS = (
    "alpha bravo cache delta echo fox grid hash index join key list mesh node "
    "overlay prefix query radix shard token unit vector wire"
).split()


class SimulatedBackend:
    """A deterministic stand-in for an engine (no model): benchmarks and overlay tests.

    * tokenize: the UTF-8 bytes of ``"role: content\\n"`` per message + ``"assistant:"``;
    * cache: every served prompt is inserted into a :class:`RadixTree` (per namespace,
      ``bytes_per_token`` each) under ``capacity_bytes``; evictions become cache events;
    * timing: one request at a time (like the real engine's single worker); prefill of the
      uncached part at ``prefill_tps`` and each output token at ``decode_tps`` (0 = no
      sleeping: for measuring overlay overhead alone);
    * output: words chosen by a hash of the prompt and position, so every node produces
      the same answer to the same prompt (as a greedy model would).
    """

    def __init__(
        self,
        *,
        model_fingerprint: bytes = b"simulated-model",
        prefill_tps: float = 0.0,
        decode_tps: float = 0.0,
        capacity_bytes: int = 1 << 30,
        bytes_per_token: int = 1024,
        max_queue: int = 64,
        context_tokens: int | None = None,
    ):
        self.model_fingerprint = model_fingerprint
        self.context_tokens = context_tokens  # None: unbounded (no context limit simulated)
        self.prefill_tps = prefill_tps
        self.decode_tps = decode_tps
        self.bytes_per_token = bytes_per_token
        self.max_queue = max_queue
        self._events: deque[CacheEvent] = deque()
        self._tree = RadixTree(capacity_bytes, on_evict=self._evicted)
        self._lock = trio.Lock()
        self._waiting = 0
        self._active = 0
        self._avg_request_s = 0.5
        self._keys: dict[bytes, bytes] = {}

    def register_namespace(self, name: str, key: bytes, ns_id: bytes) -> None:
        self._keys[ns_id] = key

    def _event(self, kind: str, ns: bytes, tokens: Sequence[int]) -> None:
        key = self._keys.get(ns)
        if key is not None:
            chain = tuple(chain_hashes(key, tokens))
            if chain:
                self._events.append(CacheEvent(kind, ns, chain))

    def _evicted(self, entry) -> None:
        ns, tokens = entry.payload
        self._event("remove", ns, tokens)

    load_began: float | None = None  # nothing to load

    def begin_load(self) -> None:
        return None

    async def load(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    async def tokenize(self, messages: Sequence[tuple[str, str]]) -> tuple[int, ...]:
        text = "".join(f"{role}: {content}\n" for role, content in messages) + "assistant:"
        return tuple(text.encode("utf-8"))

    async def tokenize_text(self, text: str) -> tuple[int, ...]:
        """A raw prompt's tokens: its UTF-8 bytes."""
        return tuple(text.encode("utf-8"))

    async def match_length(self, ns: bytes, tokens: Sequence[int]) -> int:
        m = self._tree.match((ns_pseudo_token(ns), *tokens))
        return max(0, m.length - 1)

    def insert_prefix(self, ns: bytes, tokens: Sequence[int]) -> None:
        """Put a prefix in the cache (as serving a prompt would)."""
        key = (ns_pseudo_token(ns), *tokens)
        if self._tree.get(key) is None:
            entry = self._tree.insert(key, (ns, tuple(tokens)), len(tokens) * self.bytes_per_token)
            if entry is not None:
                self._event("add", ns, tokens)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk | Completion]:
        if self._waiting >= self.max_queue:
            raise BackendOverloaded(f"{self._waiting} requests queued")
        t0 = time.perf_counter()
        self._waiting += 1
        try:
            await self._lock.acquire()
        finally:
            self._waiting -= 1
        self._active += 1
        try:
            cached = await self.match_length(request.ns, request.tokens)
            if self.prefill_tps > 0:
                await trio.sleep((len(request.tokens) - cached) / self.prefill_tps)
            self.insert_prefix(request.ns, request.tokens)
            ttft = time.perf_counter() - t0
            seed = hashlib.blake2b(bytes(str(request.tokens), "ascii"), digest_size=8).digest()
            n = request.max_tokens
            for i in range(n):
                if self.decode_tps > 0 and i:
                    await trio.sleep(1.0 / self.decode_tps)
                idx = int.from_bytes(hashlib.blake2b(seed + i.to_bytes(4, "big"), digest_size=2).digest(), "big")
                yield TokenChunk(" " + _WORDS[idx % len(_WORDS)], (idx,),
                                 cached_tokens=-1 if i else cached)
                await trio.sleep(0)
            total = time.perf_counter() - t0
            self._avg_request_s = 0.8 * self._avg_request_s + 0.2 * total
            yield Completion(len(request.tokens), cached, n, ttft, total, "length")
        finally:
            self._active -= 1
            self._lock.release()

    def load_figures(self) -> BackendLoad:
        return BackendLoad(
            queue_depth=self._waiting,
            active=self._active,
            prefill_tps=self.prefill_tps or 1e6,
            decode_tps=self.decode_tps or 1e6,
            kv_capacity_bytes=self._tree.capacity_bytes,
            kv_used_bytes=self._tree.used_bytes,
            avg_request_s=self._avg_request_s,
        )

    def drain_cache_events(self) -> list[CacheEvent]:
        out = []
        while self._events:
            out.append(self._events.popleft())
        return out


# raw prompts up to this many characters are tokenized on the trio thread (LlamaBackend)
_INLINE_TOKENIZE_CHARS = 4096


class LlamaBackend:
    """The llama.cpp engine (``inference/engine.py``) behind the :class:`Backend` protocol.

    The engine owns the only thread that calls llama.cpp; this adapter only submits
    requests and waits for their pieces in trio worker threads
    (``trio.to_thread.run_sync(..., abandon_on_cancel=True)``). When the consuming trio
    task is cancelled (client gone, deadline, shutdown) the engine request is cancelled
    too (the engine stops at its next token).
    """

    def __init__(self, engine_config=None, **engine_overrides):
        from prefixmesh.inference.model import read_gguf_info, resolve_model

        self._engine_config = engine_config
        self._engine_overrides = engine_overrides
        path = engine_overrides.get("model_path") or getattr(engine_config, "model_path", None)
        self.model_path = resolve_model(path, progress=False)
        self.model_fingerprint: bytes = read_gguf_info(self.model_path).fingerprint
        self.engine = None
        self._loader: threading.Thread | None = None  # begin_load's
        self.load_began: float | None = None
        self._built = None  # the engine the loader built, until load() takes it
        self._load_error: BaseException | None = None
        self._events: deque[CacheEvent] = deque()
        self._namespaces: dict[bytes, object] = {}
        self._pending_ns: list[tuple[str, bytes, bytes]] = []
        self._avg_request_s = 1.0

    @property
    def context_tokens(self) -> int | None:
        """The engine's context length (None until loaded): longer prompts are refused
        before routing (``context_length_exceeded``)."""
        return getattr(self.engine, "n_ctx", None)

    @property
    def vocab_size(self) -> int | None:
        """The model's vocabulary size (None until loaded): prompts given as token ids are
        checked against it at the gateway."""
        return getattr(self.engine, "n_vocab", None)

    @property
    def batched(self) -> bool:
        """True when the engine decodes in shared batches ("throughput" mode): its greedy
        output is not bit-identical to a single-sequence run (spot checks are lenient)."""
        cfg = getattr(self.engine, "config", None)
        return getattr(cfg, "batch_mode", "deterministic") == "throughput"

    def begin_load(self) -> None:
        """Start building the engine (model load, KV cache index) in a thread now; :meth:`load`
        waits for it. The node's launcher calls this before it imports the overlay, so the
        two overlap (``node/launch.py``). Idempotent."""
        if self._loader is not None:
            return

        def build() -> None:
            try:
                # imported here: llama_cpp's import is part of the load (0.1 s)
                from prefixmesh.inference.engine import Engine

                self._built = Engine(self._engine_config, model_path=self.model_path, **{
                    k: v for k, v in self._engine_overrides.items() if k != "model_path"})
            except BaseException as exc:  # handed to load(), which raises it in its caller
                self._load_error = exc

        # a daemon thread: a start-up cut short (a signal exits at once) must not wait on it
        self._loader = threading.Thread(target=build, name="prefixmesh-engine-load", daemon=True)
        self.load_began = time.monotonic()
        self._loader.start()

    async def load(self) -> None:
        self.begin_load()
        await trio.to_thread.run_sync(self._loader.join)
        if self._load_error is not None:
            exc, self._load_error = self._load_error, None
            raise exc
        self.engine, self._built = self._built, None
        self.engine.set_event_callback(self._on_cache_event)
        for name, key, ns_id in self._pending_ns:
            self._register(name, key, ns_id)
        self._pending_ns.clear()

    def _on_cache_event(self, ev) -> None:  # engine thread: deque.append is thread-safe
        if ev.chain:
            self._events.append(CacheEvent(ev.kind, ev.ns, tuple(ev.chain)))

    def register_namespace(self, name: str, key: bytes, ns_id: bytes) -> None:
        if self.engine is None:
            self._pending_ns.append((name, key, ns_id))
        else:
            self._register(name, key, ns_id)

    def _register(self, name: str, key: bytes, ns_id: bytes) -> None:
        from prefixmesh.inference.engine import Namespace

        ns = Namespace(name=name, key=key, id=ns_id)
        self._namespaces[ns_id] = ns
        self.engine.register_namespace(ns)

    async def aclose(self) -> None:
        if self._loader is not None and self.engine is None and self._load_error is None:
            # a load begun and never awaited (a start that failed after begin_load)
            await trio.to_thread.run_sync(self._loader.join)
            self.engine, self._built = self._built, None
        if self.engine is not None:
            engine, self.engine = self.engine, None
            await trio.to_thread.run_sync(lambda: engine.close(flush=True, timeout=30))

    async def tokenize(self, messages: Sequence[tuple[str, str]]) -> tuple[int, ...]:
        from prefixmesh.inference.chat import ChatError

        msgs = [{"role": r, "content": c} for r, c in messages]
        try:
            rendered = await trio.to_thread.run_sync(self.engine.render_chat, msgs)
        except ChatError as exc:
            raise BackendError(str(exc)) from None
        return tuple(rendered.tokens)

    async def tokenize_text(self, text: str) -> tuple[int, ...]:
        """A raw prompt (a completion's) as it is: special tokens parsed, no BOS added.
        A short text is tokenized inline: it only reads the vocabulary (~1 ms for 2 KB,
        measured), less than the thread round trip it saves on the warm path; a long one
        in a thread (BPE time grows faster than the text: ~70 ms for 27 KB)."""
        if len(text) <= _INLINE_TOKENIZE_CHARS:
            return tuple(self.engine.tokenize(text))
        return tuple(await trio.to_thread.run_sync(self.engine.tokenize, text))

    async def check_grammar(self, grammar: str) -> None:
        """Raise :class:`BackendInvalidRequest` if the engine cannot compile ``grammar``."""
        from prefixmesh.inference.engine import InvalidRequestError

        try:
            await trio.to_thread.run_sync(self.engine.check_grammar, grammar)
        except InvalidRequestError as exc:
            raise BackendInvalidRequest(str(exc)) from None

    @property
    def supports_tools(self) -> bool:
        """The model's chat template renders tool definitions (see inference/chat.py)."""
        renderer = getattr(self.engine, "_renderer", None)
        return bool(getattr(renderer, "supports_tools", False))

    async def tokenize_chat(self, messages: Sequence[dict], tools: Sequence[dict]
                            ) -> tuple[int, ...]:
        """A tool conversation rendered with the model's own template (OpenAI-shaped
        message dicts, tool objects); needs :attr:`supports_tools`."""
        from prefixmesh.inference.chat import ChatError

        try:
            rendered = await trio.to_thread.run_sync(
                lambda: self.engine.render_chat(list(messages), tools=list(tools)))
        except ChatError as exc:
            raise BackendError(str(exc)) from None
        return tuple(rendered.tokens)

    async def match_length(self, ns: bytes, tokens: Sequence[int]) -> int:
        namespace = self._namespaces.get(ns)
        if namespace is None or self.engine is None:
            return 0
        return self.engine.cached_tokens(namespace, tokens)[0]

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk | Completion]:
        from prefixmesh.inference.engine import (
            EngineBusy,
            EngineError,
            InvalidRequestError,
            SamplingParams,
        )

        namespace = self._namespaces.get(request.ns)
        if namespace is None or self.engine is None:
            raise BackendError("namespace not registered with the engine")
        params = SamplingParams(
            max_tokens=max(1, request.max_tokens),
            temperature=request.temperature,
            seed=request.seed if request.temperature > 0 else None,
            top_p=request.top_p if request.top_p > 0 else 1.0,
            grammar=request.grammar or None,
            logprobs=request.logprobs if request.logprobs >= 0 else None,
        )
        # The engine's worker hands each piece (and the end, None) straight to this trio
        # loop (run_sync_soon: one wake-up per token; a thread blocked in the handle's
        # iterator, as before, cost a second one and a to_thread round trip per token)
        trio_token = trio.lowlevel.current_trio_token()
        send, recv = trio.open_memory_channel[object](math.inf)  # bounded by max_tokens

        def deliver(item) -> None:  # trio thread
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                send.send_nowait(item)

        def hand_over(item) -> None:  # engine thread
            with contextlib.suppress(trio.RunFinishedError):
                trio_token.run_sync_soon(deliver, item)

        try:
            handle = self.engine.submit_tokens(request.tokens, namespace, params,
                                               on_token=hand_over,
                                               on_finish=lambda: hand_over(None))
        except EngineBusy as exc:
            raise BackendOverloaded(str(exc)) from None
        except InvalidRequestError as exc:
            raise BackendInvalidRequest(str(exc)) from None
        except (EngineError, ValueError) as exc:
            raise BackendError(str(exc)) from None
        t0 = time.perf_counter()

        try:
            first = True  # the cached count goes with the first piece only
            while True:
                piece = await recv.receive()
                if piece is None:
                    break
                lp = ()
                if piece.logprob is not None:
                    lp = (TokenLogprob(piece.data, piece.logprob, piece.top),)
                cached = -1
                if first:
                    first = False
                    st = handle.stats  # set before the first piece (engine.RequestHandle)
                    cached = st.cached_tokens if st is not None else -1
                yield TokenChunk(piece.text, (piece.token,), lp, cached_tokens=cached)
            try:
                completion = handle.result(timeout=5)
            except Exception as exc:
                raise BackendError(str(exc)) from None
            st = completion.stats
            total = time.perf_counter() - t0
            self._avg_request_s = 0.7 * self._avg_request_s + 0.3 * total
            yield Completion(
                prompt_tokens=st.prompt_tokens,
                cached_tokens=st.cached_tokens,
                completion_tokens=st.completion_tokens,
                ttft_s=st.ttft_s,
                total_s=total,
                finish_reason=completion.finish_reason,
                batched=st.batch_mode == "throughput",
                end_logprob=_end_logprob(completion.end),
            )
        finally:
            recv.close()
            if not handle.done:
                handle.cancel()

    def load_figures(self) -> BackendLoad:
        if self.engine is None:
            return BackendLoad(0, 0, 0.0, 0.0, 0, 0, self._avg_request_s)
        load = self.engine.load()
        capacity, used = self.engine.cache_usage()
        return BackendLoad(
            queue_depth=load.queue_depth,
            active=load.active,
            prefill_tps=load.prefill_tps or 400.0,  # the default model's figure until measured
            decode_tps=load.decode_tps or 100.0,
            kv_capacity_bytes=capacity,
            kv_used_bytes=used,
            avg_request_s=self._avg_request_s,
            prefill_measured=load.prefill_tps > 0,
        )

    def drain_cache_events(self) -> list[CacheEvent]:
        out = []
        while self._events:
            out.append(self._events.popleft())
        return out
