"""OpenAI-compatible HTTP gateway of a node (``prefixmesh node --http 127.0.0.1:8080``).

Endpoints
    ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/chat/completions`` and
    ``POST /v1/completions`` (streaming as server-sent events ending in ``data: [DONE]``, or
    one JSON answer), ``GET /prefixmesh/status`` (the node's in-flight requests and engine
    load, for operators and tests) and ``GET /healthz`` (no key needed).
    For operators: ``GET /metrics`` (Prometheus text format, ``node/metrics.py``),
    ``GET /prefixmesh/overview`` (the node, its peers, cached prefixes by namespace and the
    last route traces as JSON, ``node/status.py``) and ``GET /dashboard`` (a web page that
    polls the overview; static files in ``node/dashboard/``). With the gateway off,
    ``[metrics] listen`` serves only these (and ``/healthz``) on their own address.

How a request enters the mesh
    Exactly like a CLI client's: the gateway builds a ``/prefixmesh/infer`` REQUEST
    (namespace id, per-request credential, token ids, sampling, absolute deadline, hop
    budget) and hands it to the node's own request pipeline
    (:meth:`prefixmesh.overlay.infer.InferService.process`, the function the infer
    protocol handler calls for a stream from a client), so it is routed hop by hop and
    answered by whichever node holds the prefix. The prompt is tokenized here, once (the
    entry node does it anyway), which gives exact ``prompt_tokens`` and lets
    ``/v1/completions`` send a raw prompt string. A request for another model of the mesh
    is not: its messages or raw prompt text travel to a node of that model, which
    tokenizes them with its own tokenizer (the usage comes from its FINAL, or from the
    counts the serving node sends with its first token when a stop sequence ends the
    request before that FINAL).

Cancellation
    The frames of a request flow through a bounded memory channel from the pipeline task to
    the HTTP response. A task watches the ASGI ``receive`` channel; ``http.disconnect``
    (client gone) cancels the scope that runs the pipeline. The pipeline then resets the
    stream to the next hop (whose write fails, which cancels its own pipeline and engine
    request) or closes its local engine generation. Stop sequences (``stop``) are applied
    here (:class:`~prefixmesh.node.openai_schema.StopScanner`) and end the generation the
    same way. No work continues for nobody.

Authentication and tenants
    ``Authorization: Bearer KEY``. With no key configured (only allowed on a loopback
    address) every request is accepted. A key may be bound to one tenant (namespace); the
    ``x-prefixmesh-tenant`` header picks a tenant among those the key may use (an unbound
    key: every configured tenant). Without header, a bound key uses its tenant, others
    the default tenant (``[client].tenant`` if configured, else the first tenant).
    ``/metrics`` and ``/prefixmesh/overview`` show the whole node (every namespace's cache
    sizes, peers): they need a key that is not bound to a tenant (403 otherwise). The
    dashboard's static files carry no data and need no key; the page sends the key it is
    given (``/dashboard#key=KEY``, kept in the tab's session storage) with each poll.

Limits
    Request bodies: :data:`~prefixmesh.node.openai_schema.MAX_BODY_BYTES` (1 MiB), checked
    against ``Content-Length`` before reading and counted while reading (never buffered
    beyond the limit; an oversize body is read and discarded up to
    :data:`DRAIN_LIMIT_BYTES` so the client sees the 413 rather than a reset connection),
    within :data:`BODY_TIMEOUT_S`. At most ``max_concurrent`` generations at once (503
    beyond). Every request runs under its deadline (``[routing].deadline_s``).

Errors
    OpenAI error JSON ``{"error": {"message", "type", "param", "code"}}``: 400 malformed
    or invalid body, 401 missing/wrong key, 403 tenant not allowed for the key, 404
    unknown path/model/tenant, 405 wrong method, 408 body too slow, 413 body too large,
    500 engine failure, 502 upstream failed mid-stream, 503 no capacity (engine busy, no
    route, shutting down), 504 deadline. After a stream has started, an error is sent as
    one ``data: {"error": ...}`` event and the stream ends without ``[DONE]``.

Tools, structured output, logprobs
    ``tools`` are rendered into the prompt here (:mod:`.openai_tools`: the generic template,
    since the default model's own template has no tool support) and the answer is parsed
    back into ``tool_calls`` (streamed as ``delta.tool_calls``, each call in two chunks:
    id and name, then its arguments, once the call is complete). ``tool_choice``
    ``"required"`` or a named function, and ``response_format`` ``json_object`` /
    ``json_schema``, make a llama.cpp grammar here, at the entry node, that this node's
    engine compiles first (a grammar it cannot compile is a 400) and that travels in the
    REQUEST (``wire.Request.grammar``) to the serving node, whose sampler follows it.
    ``logprobs`` come back in the TOKENS frames (``wire.Tokens.logprobs``). Routing and
    caching do not change: the prompt (tools included) is still what is cached.

The route trace of an answer is in the ``prefixmesh`` field of the response (and of the
last stream chunks), which standard clients ignore; non-streaming answers also carry it
compactly in the ``x-prefixmesh-route`` header.

HTTP stack: hypercorn's trio worker (``hypercorn.trio.serve``) runs :class:`GatewayApp`, a
small ASGI application, in the node's own trio event loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hmac
import importlib.resources
import json
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import trio

from prefixmesh.overlay.core import wire

from . import ollama_api, openai_tools
from .config import is_loopback_host
from .mesh_models import job_model, model_json, models_json
from .openai_schema import (
    MAX_BODY_BYTES,
    SSE_DONE,
    ApiError,
    BadRequest,
    ChatRequest,
    CompletionRequest,
    DeadlineExceeded,
    InternalError,
    MethodNotAllowed,
    NoCapacity,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    SamplingOptions,
    StopScanner,
    Unauthorized,
    UpstreamError,
    Usage,
    chat_chunk_object,
    chat_completion_object,
    completion_chunk_object,
    completion_object,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
    sse_event,
)

__all__ = [
    "DRAIN_LIMIT_BYTES",
    "BODY_TIMEOUT_S",
    "TENANT_HEADER",
    "ROUTE_HEADER",
    "GatewayConfigError",
    "GatewaySettings",
    "GenerationJob",
    "Started",
    "TextDelta",
    "Finished",
    "GatewayBackend",
    "GatewayApp",
    "NodeGatewayBackend",
    "RequestTimeout",
    "resolve_tenant",
    "check_bind",
    "settings_from_config",
    "serve_http",
    "serve_node_http",
    "route_json",
]

log = logging.getLogger("prefixmesh.http")

#: an oversize body is read and discarded up to this many bytes before answering 413
DRAIN_LIMIT_BYTES = 8 * 1024 * 1024
#: the whole request body must arrive within this many seconds (else 408)
BODY_TIMEOUT_S = 30.0
TENANT_HEADER = "x-prefixmesh-tenant"
ROUTE_HEADER = "x-prefixmesh-route"
_EVENT_BUFFER = 16  # frames between the node pipeline and the HTTP response (backpressure)
_GRACE_S = 5.0  # beyond the request deadline before the gateway gives up by itself


class GatewayConfigError(ValueError):
    """The gateway cannot start with these settings (message says why)."""


class RequestTimeout(ApiError):
    status = 408
    type = "invalid_request_error"
    default_code = "request_timeout"


# --- settings ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GatewaySettings:
    listen: str = "127.0.0.1:8080"  # HOST:PORT or [V6]:PORT; port 0 picks a free port
    # API key -> tenant it is bound to (None: any configured tenant). Empty: no key needed
    # (only allowed on a loopback address, see check_bind).
    api_keys: Mapping[str, str | None] = field(default_factory=dict, repr=False)
    default_tenant: str = "public"
    # tenants usable over HTTP without an API key (only when no key is configured at all);
    # a private tenant always needs a key bound to it or the gateway-wide key
    public_tenants: frozenset[str] = frozenset({"public"})
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout_s: float = BODY_TIMEOUT_S
    deadline_s: float = 60.0
    default_max_tokens: int = 512
    max_concurrent: int = 32


def _split_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise GatewayConfigError(f'"{listen}" is not HOST:PORT (e.g. "127.0.0.1:8080")')
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def check_bind(settings: GatewaySettings) -> None:
    """Refuse a gateway reachable from other machines without an API key."""
    host, port = _split_listen(settings.listen)
    if not 0 <= port <= 65535:
        raise GatewayConfigError(f'"{settings.listen}": port out of range')
    if not is_loopback_host(host) and not settings.api_keys:
        raise GatewayConfigError(
            f'HTTP gateway on "{settings.listen}" is reachable from other machines; '
            "set [http].api_key (or bind to 127.0.0.1)")
    if any(not k for k in settings.api_keys):
        raise GatewayConfigError("an API key must not be empty")


def settings_from_config(cfg: Any) -> GatewaySettings:
    """Gateway settings from a :class:`prefixmesh.node.config.Config`.

    Reads ``[http].listen``, ``[http].api_key`` (unbound: any tenant) and, when the config
    model has it, ``[http].keys`` (a table KEY = TENANT binding keys to tenants)."""
    keys: dict[str, str | None] = {}
    if cfg.http.api_key:
        keys[cfg.http.api_key] = None
    for key, tenant in dict(getattr(cfg.http, "keys", None) or {}).items():
        keys[str(key)] = str(tenant)
    names = [s.name for s in cfg.tenant_specs()]
    default = cfg.client.tenant if cfg.client.tenant in names else names[0]
    return GatewaySettings(
        listen=cfg.http.listen,
        api_keys=keys,
        default_tenant=default,
        public_tenants=frozenset(s.name for s in cfg.tenant_specs() if s.public),
        deadline_s=float(cfg.routing.deadline_s),
        default_max_tokens=int(cfg.client.max_tokens),
    )


# --- the backend interface ----------------------------------------------------------------


@dataclass(frozen=True)
class GenerationJob:
    """One generation, as the gateway asks for it (already validated)."""

    tenant: str
    sampling: SamplingOptions
    deadline_s: float  # relative: seconds from now
    messages: tuple[tuple[str, str], ...] = ()  # chat: rendered with the model's template
    # completions: raw text (tokenized as is) or token ids of our model (used as they are)
    prompt: str | tuple[int, ...] | None = None
    grammar: str = ""  # llama.cpp GBNF the answer must follow ("": unconstrained)
    # chat with tools: (messages, tools) as OpenAI dicts, rendered by the model's own
    # template when it supports tools (else ``messages``, the generic rendering, is used)
    tool_chat: tuple | None = None
    logprobs: int = -1  # -1: none; else alternatives per token (0..20)
    # the fingerprint of another model of the mesh that must answer (b"": this node's);
    # such a job is never tokenized or served here: its messages or raw prompt go as text
    # to a node of it, which tokenizes them with its own tokenizer
    model: bytes = b""


@dataclass(frozen=True)
class Started:
    """The prompt is tokenized and the request has entered the mesh."""

    prompt_tokens: int


@dataclass(frozen=True)
class PromptCounted:
    """The serving node's counts of the prompt, with its first text (before its FINAL):
    what the usage says when the gateway stops reading early (a stop sequence). For
    another model's request only that node knows them."""

    prompt_tokens: int
    cached_tokens: int = -1  # -1: not said


@dataclass(frozen=True)
class TextDelta:
    text: str
    tokens: int  # generated tokens this text stands for
    logprobs: tuple = ()  # wire.TokenLogprob per token, when the job asked for logprobs


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "stop" | "length"
    usage: Usage
    route: dict[str, Any] | None = None  # route_json(final)


GatewayEvent = Started | PromptCounted | TextDelta | Finished


class GatewayBackend(Protocol):
    """What the HTTP layer needs from a node (a fake one in unit tests)."""

    def model_ids(self) -> list[str]: ...

    def tenant_names(self) -> list[str]: ...

    def generation(self, job: GenerationJob) -> contextlib.AbstractAsyncContextManager[
            AsyncIterator[GatewayEvent]]:
        """``async with backend.generation(job) as events: async for ev in events: ...``

        Yields one :class:`Started`, :class:`TextDelta` s, then one :class:`Finished`; a
        failure is an :class:`ApiError` raised from the iteration (or from entering).
        Leaving the ``async with`` early cancels the generation wherever it runs."""
        ...

    def status(self) -> dict[str, Any]: ...

    # optional (a backend without them answers 404): the operator endpoints
    # def metrics_text(self) -> bytes          -- Prometheus exposition
    # def overview(self) -> dict[str, Any]     -- node/status.py overview


# --- tenant resolution (pure) ----------------------------------------------------------


def _match_key(api_keys: Mapping[str, str | None], presented: str) -> str | None:
    """The configured key equal to ``presented`` (compared in constant time), or None."""
    found = None
    for key in api_keys:
        if hmac.compare_digest(key.encode(), presented.encode()):
            found = key
    return found


def resolve_tenant(settings: GatewaySettings, authorization: str | None,
                   tenant_header: str | None, known_tenants: Sequence[str]) -> str:
    """The tenant a request runs in; raises :class:`Unauthorized`, :class:`PermissionDenied`
    or :class:`NotFound`. With no API key configured only ``settings.public_tenants`` are
    served: a private tenant needs a key bound to it or the gateway-wide key."""
    bound: str | None = None
    if settings.api_keys:
        if not authorization:
            raise Unauthorized("missing API key: send 'Authorization: Bearer KEY'",
                               code="missing_api_key")
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthorized("malformed Authorization header: expected 'Bearer KEY'")
        key = _match_key(settings.api_keys, token.strip())
        if key is None:
            raise Unauthorized("invalid API key")
        bound = settings.api_keys[key]
    if tenant_header:
        name = tenant_header.strip()
        if bound is not None and name != bound:
            raise PermissionDenied(f"this API key may not use tenant {name!r}")
        if name not in known_tenants:
            raise NotFound(f"tenant {name!r} is not configured on this node",
                           param=TENANT_HEADER, code="tenant_not_found")
    else:
        name = bound if bound is not None else settings.default_tenant
        if name not in known_tenants:
            raise NotFound(f"tenant {name!r} is not configured on this node",
                           code="tenant_not_found")
    if not settings.api_keys and name not in settings.public_tenants:
        # no key at all: a private namespace's secret is not for any local HTTP client
        raise Unauthorized(
            f"tenant {name!r} is private: over HTTP it needs an API key; configure "
            f'[http.keys] "KEY" = "{name}" (or [http].api_key) and send '
            "'Authorization: Bearer KEY'", code="api_key_required")
    return name


def check_operator(settings: GatewaySettings, authorization: str | None) -> None:
    """The operator endpoints' rule: with keys configured, a valid key not bound to a tenant
    (a tenant's key must not see other tenants' cache sizes or the node's peers)."""
    if not settings.api_keys:
        return
    if not authorization:
        raise Unauthorized("missing API key: send 'Authorization: Bearer KEY'",
                           code="missing_api_key")
    scheme, _, token = authorization.strip().partition(" ")
    key = _match_key(settings.api_keys, token.strip()) if scheme.lower() == "bearer" else None
    if key is None:
        raise Unauthorized("invalid API key")
    if settings.api_keys[key] is not None:
        raise PermissionDenied("this API key is bound to a tenant; metrics and the node "
                               "overview need the node's [http].api_key")


#: the dashboard's files (package ``prefixmesh.node.dashboard``) and their content types
_STATIC_TYPES = {".html": b"text/html; charset=utf-8", ".js": b"text/javascript; charset=utf-8",
                 ".css": b"text/css; charset=utf-8", ".svg": b"image/svg+xml"}
_STATIC_CACHE: dict[str, bytes] = {}
# the page loads only its own files and talks only to this node (no inline code, no CDN)
_CSP = (b"default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        b"img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def _static_file(name: str) -> bytes | None:
    if name not in _STATIC_CACHE:
        if "/" in name or name.startswith(".") or Path(name).suffix not in _STATIC_TYPES:
            return None
        try:
            res = importlib.resources.files("prefixmesh.node.dashboard").joinpath(name)
            _STATIC_CACHE[name] = res.read_bytes()
        except (FileNotFoundError, IsADirectoryError, ModuleNotFoundError):
            return None
    return _STATIC_CACHE[name]


# --- the ASGI application ----------------------------------------------------------------


class _ClientGone(Exception):
    """The HTTP client disconnected."""


def _headers(scope: Mapping[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in scope.get("headers", ()):
        out[name.decode("latin-1").lower()] = value.decode("latin-1")
    return out


class _Sender:
    """The ASGI ``send`` callable, remembering how far the response got."""

    def __init__(self, send):
        self._send = send
        self.started = False  # http.response.start sent
        self.finishing = False  # the last body message is being (or has been) sent

    async def __call__(self, message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        elif message["type"] == "http.response.body" and not message.get("more_body"):
            self.finishing = True
        await self._send(message)


@dataclass
class _Outcome:
    finish_reason: str
    usage: Usage
    route: dict[str, Any] | None
    partial: bool = False  # ended at a stop sequence: usage counted here, no route trace
    cached_known: bool = True  # False: cached_tokens was never said (reported as 0)


class GatewayApp:
    """The ASGI application (one instance per gateway)."""

    def __init__(self, backend: GatewayBackend, settings: GatewaySettings, *,
                 clock: Callable[[], float] = time.time, api: bool = True):
        self.backend = backend
        self.settings = settings
        self.clock = clock
        self.api = api  # False: only the operator endpoints ([metrics] listen)
        self.active = 0  # generations in flight through this gateway
        self.stats = {"requests": 0, "errors": 0, "disconnects": 0, "stopped_at_sequence": 0}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        self.stats["requests"] += 1
        sender = _Sender(send)
        try:
            await self._dispatch(scope, receive, sender)
        except _ClientGone:
            self.stats["disconnects"] += 1
        except ApiError as exc:
            self.stats["errors"] += 1
            if not sender.started:
                await _send_json(sender, exc.status, exc.body(), _allow_header(exc))
        except Exception:
            log.exception("HTTP gateway: unexpected error")
            self.stats["errors"] += 1
            if not sender.started:
                await _send_json(sender, 500, InternalError("internal error").body())

    async def _dispatch(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        method = scope.get("method", "GET")
        headers = _headers(scope)
        if path == "/healthz":
            _method(method, "GET")
            await _send_json(send, 200, {"ok": True})
            return
        if path in ("/metrics", "/prefixmesh/overview") or path.startswith("/dashboard"):
            await self._operator(path, method, headers, receive, send)
            return
        if not self.api:
            await _drain(receive, DRAIN_LIMIT_BYTES, 2.0)
            raise NotFound(f"no such endpoint here: {method} {path} (this listener serves "
                           "only /metrics, /prefixmesh/overview and /dashboard)",
                           code="unknown_url")
        if path.startswith("/api/"):  # the Ollama API, same rules (node/ollama_api.py)
            hooks = ollama_api.GatewayHooks(
                resolve_tenant=lambda: resolve_tenant(
                    self.settings, headers.get("authorization"), headers.get(TENANT_HEADER),
                    self.backend.tenant_names()),
                read_body=lambda: self._read_body(receive, headers), run=self._run,
                send_json=_send_json, drain=lambda: _drain(receive, DRAIN_LIMIT_BYTES, 2.0),
                make_job=GenerationJob)
            await ollama_api.handle(self, hooks, path, method, send)
            return
        routes = {"/v1/models": "GET", "/v1/chat/completions": "POST",
                  "/v1/completions": "POST", "/prefixmesh/status": "GET"}
        if path in routes:
            want = routes[path]
        elif path.startswith("/v1/models/"):
            want = "GET"
        else:
            await _drain(receive, DRAIN_LIMIT_BYTES, 2.0)
            raise NotFound(f"no such endpoint: {method} {path}", code="unknown_url")
        if method != want:
            await _drain(receive, DRAIN_LIMIT_BYTES, 2.0)
            _method(method, want)
        try:
            tenant = resolve_tenant(self.settings, headers.get("authorization"),
                                    headers.get(TENANT_HEADER), self.backend.tenant_names())
        except ApiError:
            await _drain(receive, DRAIN_LIMIT_BYTES, 2.0)
            raise
        if path == "/v1/models":
            await _send_json(send, 200, models_json(self.backend))
        elif path.startswith("/v1/models/"):
            model = path[len("/v1/models/"):]
            found = model_json(self.backend, model)
            if found is None:
                raise NotFound(f"model {model[:120]!r} does not exist", param="model",
                               code="model_not_found")
            await _send_json(send, 200, found)
        elif path == "/prefixmesh/status":
            status = dict(self.backend.status())
            status["gateway"] = {"active": self.active, **self.stats}
            await _send_json(send, 200, status)
        else:
            body = await self._read_body(receive, headers)
            obj = parse_json_body(body)
            s = self.settings
            if path == "/v1/chat/completions":
                req: ChatRequest | CompletionRequest = parse_chat_request(
                    obj, default_max_tokens=s.default_max_tokens)
                job = GenerationJob(tenant=tenant, sampling=req.sampling,
                                    deadline_s=s.deadline_s, messages=req.messages,
                                    grammar=_grammar(req), logprobs=req.logprobs,
                                    tool_chat=req.tool_chat)
            else:
                req = parse_completion_request(obj, default_max_tokens=s.default_max_tokens)
                job = GenerationJob(tenant=tenant, sampling=req.sampling,
                                    deadline_s=s.deadline_s, prompt=req.prompt,
                                    logprobs=req.logprobs)
            fp = job_model(self.backend, req.model)
            if fp is None:
                raise NotFound(f"model {req.model[:120]!r} does not exist: no node of the mesh "
                               "serves it now (see GET /v1/models)",
                               param="model", code="model_not_found")
            if fp and isinstance(job.prompt, tuple):  # ids of another vocabulary than ours
                raise BadRequest("a prompt of token ids is taken for this node's own model "
                                 "only (the first of GET /v1/models): send text for a model "
                                 "another node serves", param="prompt", code="unsupported_value")
            job = dataclasses.replace(job, model=fp)
            if self.active >= s.max_concurrent:
                raise NoCapacity(f"the gateway is serving {self.active} requests, its limit")
            self.active += 1
            try:
                await self._generate(req, job, receive, send)
            finally:
                self.active -= 1

    async def _operator(self, path: str, method: str, headers, receive, send) -> None:
        if method != "GET":
            await _drain(receive, DRAIN_LIMIT_BYTES, 2.0)
            _method(method, "GET")
        if path.startswith("/dashboard"):
            name = path[len("/dashboard"):].lstrip("/") or "index.html"
            body = _static_file(name)
            if body is None:
                raise NotFound(f"no such dashboard file: {name}", code="unknown_url")
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", _STATIC_TYPES[Path(name).suffix]),
                (b"content-length", str(len(body)).encode()),
                (b"content-security-policy", _CSP),
                (b"x-content-type-options", b"nosniff"),
                (b"referrer-policy", b"no-referrer"),
                (b"cache-control", b"no-cache"),
            ]})
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        check_operator(self.settings, headers.get("authorization"))
        if path == "/metrics":
            text = getattr(self.backend, "metrics_text", None)
            if text is None:
                raise NotFound("this node has no metrics", code="unknown_url")
            from .metrics import CONTENT_TYPE_LATEST

            body = text()
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", CONTENT_TYPE_LATEST.encode()),
                (b"content-length", str(len(body)).encode()),
            ]})
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        ov = getattr(self.backend, "overview", None)
        if ov is None:
            raise NotFound("this node has no overview", code="unknown_url")
        data = ov()
        data["gateway"] = {"active": self.active, **self.stats} if self.api else None
        await _send_json(send, 200, data, [(b"cache-control", b"no-store")])

    async def _read_body(self, receive, headers: Mapping[str, str]) -> bytes:
        limit = self.settings.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            await _drain(receive, DRAIN_LIMIT_BYTES, 5.0)
            raise PayloadTooLarge(f"request body of {int(declared)} bytes exceeds the "
                                  f"{limit}-byte limit")
        chunks: list[bytes] = []
        size = 0
        with trio.move_on_after(self.settings.body_timeout_s) as timer:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    raise _ClientGone()
                data = msg.get("body", b"")
                size += len(data)
                if size > limit:
                    chunks.clear()
                    break
                chunks.append(data)
                if not msg.get("more_body", False):
                    break
        if size > limit:
            await _drain(receive, DRAIN_LIMIT_BYTES - size, 5.0)
            raise PayloadTooLarge(f"request body exceeds the {limit}-byte limit")
        if timer.cancelled_caught:
            raise RequestTimeout(
                f"the request body did not arrive within {self.settings.body_timeout_s:g} s")
        return b"".join(chunks)

    # --- generation ----------------------------------------------------------------------

    async def _generate(self, req, job: GenerationJob, receive, send) -> None:
        chat = isinstance(req, ChatRequest)
        rid = ("chatcmpl-" if chat else "cmpl-") + os.urandom(12).hex()
        created = int(self.clock())
        gone = {"flag": False}
        raised: Exception | None = None
        async with trio.open_nursery() as nursery:

            async def watch_disconnect() -> None:
                while True:
                    msg = await receive()
                    # hypercorn reports http.disconnect as soon as the last body message
                    # is written, before that send returns: that is no disconnect
                    if msg["type"] == "http.disconnect" and not send.finishing:
                        gone["flag"] = True
                        nursery.cancel_scope.cancel()
                        return
                    if msg["type"] == "http.disconnect":
                        return

            nursery.start_soon(watch_disconnect)
            answered = False
            try:
                if req.stream:
                    await self._stream(req, job, rid, created, send)
                else:
                    await self._complete(req, job, rid, created, send)
                answered = True
            except Exception as exc:  # re-raised below, outside the nursery (no group)
                raised = exc
            nursery.cancel_scope.cancel()
        if gone["flag"] and not answered:
            raise _ClientGone()
        if raised is not None:
            raise raised

    async def _run(self, job: GenerationJob, on_text: Callable[[str], Awaitable[None]],
                   logprobs: list | None = None) -> _Outcome:
        """Run one generation, passing text (stop sequences applied) to ``on_text``; with
        ``logprobs`` (a list), the entries of the tokens whose text has been passed on are
        appended to it before each ``on_text`` call (matched by UTF-8 bytes, so the tokens
        of a stop sequence cut off here are left out)."""
        scanner = StopScanner(job.sampling.stop)
        prompt_tokens = 0
        cached_tokens = -1  # not said yet
        generated = 0
        outcome: _Outcome | None = None
        lp = _LogprobGate(logprobs)
        with trio.move_on_after(job.deadline_s + _GRACE_S) as overall:
            async with self.backend.generation(job) as events:
                async for ev in events:
                    if isinstance(ev, Started):
                        prompt_tokens = ev.prompt_tokens
                    elif isinstance(ev, PromptCounted):
                        # the serving node's count: the one a FINAL would carry
                        prompt_tokens = ev.prompt_tokens
                        cached_tokens = ev.cached_tokens
                    elif isinstance(ev, TextDelta):
                        generated += ev.tokens
                        lp.add(ev.logprobs)
                        text = scanner.feed(ev.text)
                        if text:
                            lp.release(text)
                            await on_text(text)
                        if scanner.stopped:
                            break  # leaving the context cancels the generation
                    elif isinstance(ev, Finished):
                        rest = scanner.flush()
                        lp.release(rest, everything=True)
                        if rest or lp.flushed:
                            await on_text(rest)
                        outcome = _Outcome(ev.finish_reason, ev.usage, ev.route)
                        break
        if outcome is not None:
            return outcome
        if scanner.stopped:
            self.stats["stopped_at_sequence"] += 1
            return _Outcome("stop", Usage(prompt_tokens, generated, max(cached_tokens, 0)), None,
                            partial=True, cached_known=cached_tokens >= 0)
        if overall.cancelled_caught:
            raise DeadlineExceeded(f"no answer within {job.deadline_s:g} s")
        raise UpstreamError("the generation ended without a final answer")

    async def _complete(self, req, job: GenerationJob, rid: str, created: int, send) -> None:
        parts: list[str] = []
        lps: list | None = [] if job.logprobs >= 0 else None

        async def collect(text: str) -> None:
            parts.append(text)

        out = await self._run(job, collect, lps)
        text = "".join(parts)
        ext = _ext(out)
        if isinstance(req, ChatRequest):
            content: str | None = text
            calls: list[openai_tools.ToolCall] = []
            finish = out.finish_reason
            names = _tool_names(req)
            if names:
                content, found = openai_tools.parse_tool_calls(text, names)
                calls = [openai_tools.ToolCall(_call_id(), n, a) for n, a in found]
                if calls and finish == "stop":
                    finish = "tool_calls"
            body = chat_completion_object(id=rid, created=created, model=req.model,
                                          text=content, finish_reason=finish, usage=out.usage,
                                          ext=ext, tool_calls=calls, logprobs=lps)
        else:
            body = completion_object(id=rid, created=created, model=req.model, text=text,
                                     finish_reason=out.finish_reason, usage=out.usage, ext=ext,
                                     logprobs=lps)
        extra: list[tuple[bytes, bytes]] = []
        if out.route is not None:
            extra.append((ROUTE_HEADER.encode(), _route_header(out.route)))
        await _send_json(send, 200, body, extra)

    async def _stream(self, req, job: GenerationJob, rid: str, created: int, send) -> None:
        chat = isinstance(req, ChatRequest)
        model = req.model
        state = {"started": False, "role_sent": False}

        async def start() -> None:
            if not state["started"]:
                state["started"] = True
                await send({"type": "http.response.start", "status": 200, "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),
                ]})

        async def event(obj: Mapping[str, Any]) -> None:
            await start()
            await send({"type": "http.response.body", "body": sse_event(obj),
                        "more_body": True})

        lps: list | None = [] if job.logprobs >= 0 else None
        offset = {"chars": 0}

        def take_logprobs() -> list | None:
            if lps is None:
                return None
            got = list(lps)
            lps.clear()
            return got

        def chunk(delta=None, text=None, finish=None, usage=None, ext=None, usage_chunk=False,
                  logprobs=None):
            if chat:
                return chat_chunk_object(
                    id=rid, created=created, model=model,
                    delta=None if usage_chunk else (delta or {}), finish_reason=finish,
                    usage=usage, include_usage_field=req.include_usage, ext=ext,
                    logprobs=logprobs)
            return completion_chunk_object(
                id=rid, created=created, model=model, text=None if usage_chunk else (text or ""),
                finish_reason=finish, usage=usage, ext=ext, logprobs=logprobs,
                text_offset=offset["chars"])

        names = _tool_names(req) if chat else ()
        parser = openai_tools.ToolStreamParser(names) if names else None

        async def role() -> None:
            if chat and not state["role_sent"]:
                state["role_sent"] = True
                await event(chunk(delta={"role": "assistant", "content": ""}))

        async def emit(events: list[tuple]) -> None:
            for ev in events:
                await role()
                if ev[0] == "content":
                    if ev[1]:
                        await event(chunk(delta={"content": ev[1]},
                                          logprobs=take_logprobs()))
                    continue
                i = state.setdefault("calls", 0)
                state["calls"] = i + 1
                await event(chunk(delta={"tool_calls": [{
                    "index": i, "id": _call_id(), "type": "function",
                    "function": {"name": ev[1], "arguments": ""}}]}))
                await event(chunk(delta={"tool_calls": [{
                    "index": i, "function": {"arguments": ev[2]}}]},
                    logprobs=take_logprobs()))

        async def on_text(text: str) -> None:
            if parser is not None:
                await emit(parser.feed(text))
                return
            if not text and not lps:
                return
            await role()
            await event(chunk(delta={"content": text}, text=text, logprobs=take_logprobs()))
            offset["chars"] += len(text)

        try:
            out = await self._run(job, on_text, lps)
            if parser is not None:
                await emit(parser.finish())
        except ApiError as exc:
            if not state["started"]:
                raise
            self.stats["errors"] += 1
            await send({"type": "http.response.body", "body": sse_event(exc.body()),
                        "more_body": False})
            return
        ext = _ext(out)
        if chat and not state["role_sent"]:
            await event(chunk(delta={"role": "assistant", "content": ""}))
        finish = out.finish_reason
        if state.get("calls") and finish == "stop":
            finish = "tool_calls"
        rest = take_logprobs()
        await event(chunk(delta={}, finish=finish, ext=ext, logprobs=rest or None))
        if req.include_usage:
            await event(chunk(usage=out.usage, ext=ext, usage_chunk=True))
        await start()
        await send({"type": "http.response.body", "body": SSE_DONE, "more_body": False})


def _tool_names(req: ChatRequest) -> tuple[str, ...]:
    """The declared tools' names when the answer is to be parsed for tool calls."""
    spec = req.tools
    if spec is None or spec.choice == "none":
        return ()
    return spec.names


def _grammar(req: ChatRequest) -> str:
    """The llama.cpp grammar a chat request's answer must follow ("" if none)."""
    try:
        if req.tools is not None and req.tools.constrained:
            return openai_tools.tool_grammar(req.tools)
        if req.response_format is not None:
            return openai_tools.format_grammar(req.response_format)
    except openai_tools.ToolsError as exc:
        raise BadRequest(exc.message, param=exc.param, code=exc.code) from None
    return ""


def _call_id() -> str:
    return "call_" + os.urandom(12).hex()


class _LogprobGate:
    """Passes logprob entries on (to ``out``) once the text of their tokens has been
    passed on: the text the gateway holds back or cuts (stop sequences) keeps its
    tokens' entries back too. Matched by UTF-8 byte counts."""

    def __init__(self, out: list | None):
        self.out = out
        self._pending: list = []
        self._budget = 0  # bytes of released text not yet matched with entries
        self.flushed = False  # the last release passed entries on

    def add(self, entries) -> None:
        if self.out is not None:
            self._pending.extend(entries)

    def release(self, text: str, *, everything: bool = False) -> None:
        if self.out is None:
            return
        self.flushed = False
        self._budget += len(text.encode("utf-8"))
        while self._pending and (everything or len(self._pending[0].piece) <= self._budget):
            e = self._pending.pop(0)
            self._budget = max(0, self._budget - len(e.piece))
            self.out.append(e)
            self.flushed = True


def _ext(out: _Outcome) -> dict[str, Any]:
    ext: dict[str, Any] = {"route": out.route}
    if out.partial:
        ext["stopped_at_gateway"] = True  # the route is unknown (no FINAL; see docs)
        if not out.cached_known:
            ext["cached_tokens_unknown"] = True  # the serving node did not say it
    return ext


def _method(method: str, want: str) -> None:
    if method != want:
        exc = MethodNotAllowed(f"method {method} not allowed here (use {want})")
        exc.allow = want  # type: ignore[attr-defined]
        raise exc


def _allow_header(exc: ApiError) -> list[tuple[bytes, bytes]]:
    allow = getattr(exc, "allow", None)
    return [(b"allow", allow.encode())] if allow else []


async def _send_json(send, status: int, obj: Any,
                     extra_headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *extra_headers,
    ]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _drain(receive, limit: int, timeout_s: float) -> None:
    """Read and discard the rest of a request body (bounded in bytes and time), so that
    the client, still sending, reads our error answer instead of a reset connection."""
    seen = 0
    with trio.move_on_after(timeout_s):
        while seen <= limit:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            seen += len(msg.get("body", b""))
            if not msg.get("more_body", False):
                return


def _route_header(route: Mapping[str, Any]) -> bytes:
    """The route trace without free-text reasons, as compact ASCII JSON."""
    compact = {
        "entry": route.get("entry"),
        "serving": route.get("serving"),
        "batched": bool(route.get("batched")),
        "hops": [{k: v for k, v in hop.items() if k in ("peer", "action", "next", "matched")}
                 for hop in route.get("hops", [])],
    }
    return json.dumps(compact, separators=(",", ":"), ensure_ascii=True).encode("ascii")


# --- the real node -----------------------------------------------------------------------


def route_json(final) -> dict[str, Any]:
    """A ``wire.Final``'s route trace as JSON-able data (peer ids in base58)."""
    from prefixmesh.overlay.core.identity import peer_id_to_b58

    def b58(pid: bytes) -> str | None:
        try:
            return peer_id_to_b58(pid) if pid else None
        except Exception:  # a malformed id from a peer: show it raw
            return pid.hex()

    def ms(x: float) -> float | None:
        return round(x, 2) if x >= 0 and math.isfinite(x) else None

    hops = []
    for h in final.hops:
        hop: dict[str, Any] = {"peer": b58(h.peer), "action": h.action, "reason": h.reason,
                               "matched": h.local_matched_tokens, "ttft_ms": ms(h.ttft_ms)}
        if h.next_peer:
            hop["next"] = b58(h.next_peer)
        hops.append(hop)
    # batched: the serving engine decoded it in a shared batch (throughput mode), so a
    # greedy answer may differ from a deterministic run of the same prompt
    return {"entry": b58(final.entry), "serving": b58(final.serving),
            "ttft_ms": ms(final.ttft_ms), "total_ms": ms(final.total_ms),
            "batched": final.batched, "hops": hops}


_WIRE_ERRORS: dict[str, type[ApiError]] = {
    "bad_request": BadRequest,
    "context_length_exceeded": BadRequest,  # decided by the entry node's planner (400)
    "duplicate": BadRequest,
    "unauthorized": Unauthorized,
    "unknown_namespace": NotFound,
    "overloaded": NoCapacity,
    "no_route": NoCapacity,
    "shutting_down": NoCapacity,
    "deadline": DeadlineExceeded,
    "upstream_failed": UpstreamError,
    "internal": InternalError,
}


def _api_error(frame) -> ApiError:
    if frame.code == "unknown_model":  # OpenAI's answer to a model nobody serves
        return NotFound(f"model_not_found: {frame.message}", param="model",
                        code="model_not_found")
    cls = _WIRE_ERRORS.get(frame.code, InternalError)
    return cls(f"{frame.code}: {frame.message}", code=frame.code)


class _FrameEvents:
    """Async iterator turning infer frames into :data:`GatewayEvent` s."""

    def __init__(self, prompt_tokens: int, recv: trio.MemoryReceiveChannel):
        self._recv = recv
        self._pending: list[GatewayEvent] = [Started(prompt_tokens)]
        self._done = False
        self.answered = False  # a FINAL came

    def __aiter__(self) -> _FrameEvents:
        return self

    async def __anext__(self) -> GatewayEvent:
        if self._pending:
            return self._pending.pop(0)
        if self._done:
            raise StopAsyncIteration
        try:
            frame = await self._recv.receive()
        except trio.EndOfChannel:
            self._done = True
            raise UpstreamError("the node's pipeline ended without an answer") from None
        if isinstance(frame, wire.Tokens):
            n = len(frame.token_ids) or (1 if frame.text else 0)
            delta = TextDelta(frame.text, n, frame.logprobs)
            if frame.prompt_tokens:  # the serving node's first text: its counts come first
                self._pending.append(delta)
                return PromptCounted(frame.prompt_tokens, frame.cached_tokens)
            return delta
        if isinstance(frame, wire.Final):
            self._done = True
            self.answered = True
            usage = Usage(frame.prompt_tokens, frame.completion_tokens, frame.cached_tokens)
            return Finished(frame.finish_reason, usage, route_json(frame))
        if isinstance(frame, wire.Error):
            self._done = True
            raise _api_error(frame)
        raise UpstreamError(f"unexpected frame {type(frame).__name__}")


class NodeGatewayBackend:
    """:class:`GatewayBackend` over a running node's request pipeline.

    ``infer`` is the node's :class:`~prefixmesh.overlay.infer.InferService`; ``backend``
    its engine :class:`~prefixmesh.inference.backend.Backend` (for tokenizing and load
    figures); ``tenants`` its :class:`~prefixmesh.node.tenants.TenantRegistry`."""

    def __init__(self, *, infer, backend, tenants, hop_budget: int = 2,
                 model_ids: Sequence[str] | None = None,
                 clock: Callable[[], float] = time.time, node=None, metrics=None):
        self.infer = infer
        self.backend = backend
        self.tenants = tenants
        self.hop_budget = hop_budget
        self.clock = clock
        self._model_ids = list(model_ids) if model_ids else default_model_ids(backend)
        self.node = node  # the daemon's Node: the operator endpoints read it
        self.metrics = metrics  # its node.metrics.NodeMetrics
        self._foreign_tenants: dict[tuple[str, bytes], Any] = {}  # other models' keys

    def metrics_text(self) -> bytes:
        if self.metrics is None:
            raise NotFound("this node has no metrics", code="unknown_url")
        return self.metrics.exposition()

    def overview(self) -> dict[str, Any]:
        if self.node is None:
            raise NotFound("this node has no overview", code="unknown_url")
        from .status import overview

        return overview(self.node, self.metrics)

    def model_ids(self) -> list[str]:
        return list(self._model_ids)

    def model_catalog(self):
        """The models the mesh serves now (``core/models.ModelEntry``, ours first)."""
        from prefixmesh.overlay.core.models import ModelEntry

        models = getattr(self.node, "models", None)
        if models is not None:
            return models()
        return (ModelEntry(bytes(self.backend.model_fingerprint), self._model_ids[0], 1, True),)

    def resolve_model(self, name: str):
        """The catalog entry ``name`` names (``core/models.resolve``), or None."""
        from prefixmesh.overlay.core.models import resolve

        return resolve(name, self.model_catalog())

    def _tenant_for(self, name: str, model: bytes):
        """The tenant ``name`` bound to ``model`` (b"": ours): namespace keys are per model."""
        from .tenants import Tenant

        tenant = self.tenants.by_name(name)
        if tenant is None or not model:
            return tenant
        key = (name, model)
        found = self._foreign_tenants.get(key)
        if found is None:
            if len(self._foreign_tenants) >= _MAX_FOREIGN_TENANTS:
                self._foreign_tenants.clear()
            found = self._foreign_tenants[key] = Tenant.derive(tenant.spec, model)
        return found

    def tenant_names(self) -> list[str]:
        return self.tenants.names()

    def status(self) -> dict[str, Any]:
        load = self.backend.load_figures()
        return {
            "inflight": self.infer.inflight,
            "engine": {"active": load.active, "queue_depth": load.queue_depth,
                       "kv_used_bytes": load.kv_used_bytes,
                       "kv_capacity_bytes": load.kv_capacity_bytes},
            "infer": dict(self.infer.stats),
        }

    async def _prompt_tokens(self, job: GenerationJob) -> tuple[int, ...]:
        from prefixmesh.inference.backend import BackendError

        try:
            if job.prompt is None:
                if job.tool_chat is not None and getattr(self.backend, "supports_tools", False):
                    return tuple(await self.backend.tokenize_chat(*job.tool_chat))
                return tuple(await self.backend.tokenize(job.messages))
            if isinstance(job.prompt, tuple):
                n_vocab = getattr(self.backend, "vocab_size", None)  # None: the engine checks
                top = max(job.prompt)
                if n_vocab is not None and top >= n_vocab:
                    raise BadRequest(f"token id {top} in 'prompt' is not in the "
                                     f"model's vocabulary of {n_vocab}", param="prompt",
                                     code="invalid_value")
                return job.prompt
            return tuple(await self.backend.tokenize_text(job.prompt))
        except (BackendError, ValueError) as exc:
            raise BadRequest(f"cannot render the prompt: {exc}", code="invalid_prompt") from None

    async def _check_grammar(self, grammar: str) -> None:
        """The entry node's check of an output constraint: its own engine compiles it."""
        check = getattr(self.backend, "check_grammar", None)
        if check is None:
            return
        from prefixmesh.inference.backend import BackendError

        try:
            await check(grammar)
        except BackendError as exc:
            raise BadRequest(f"the output constraint cannot be compiled: {exc}",
                             param="response_format", code="invalid_schema") from None

    @contextlib.asynccontextmanager
    async def generation(self, job: GenerationJob) -> AsyncIterator[AsyncIterator[GatewayEvent]]:
        tenant = self._tenant_for(job.tenant, job.model)
        if tenant is None:
            raise NotFound(f"tenant {job.tenant!r} is not configured", code="tenant_not_found")
        if job.model:  # another model's: its node renders and tokenizes (our tokenizer is ours)
            if job.prompt is not None and len(job.prompt) > wire.MAX_PROMPT_CHARS:
                raise BadRequest(f"the prompt has {len(job.prompt)} characters, more than the "
                                 f"{wire.MAX_PROMPT_CHARS} a prompt for another model's node "
                                 "may carry", code="context_length_exceeded")
            tokens: tuple[int, ...] = ()
        else:
            tokens = await self._prompt_tokens(job)
        if not tokens and not job.model:
            raise BadRequest("the prompt is empty after tokenization", code="invalid_prompt")
        if len(tokens) > wire.MAX_PROMPT_TOKENS:
            raise BadRequest(f"the prompt has {len(tokens)} tokens, more than "
                             f"{wire.MAX_PROMPT_TOKENS}", code="context_length_exceeded")
        if job.grammar:
            await self._check_grammar(job.grammar)
        s = job.sampling
        request_id = os.urandom(16)
        deadline = self.clock() + job.deadline_s
        req = tenant.sign(wire.Request(  # the credential binds id, deadline and content
            id=request_id,
            ns=tenant.ns_id,
            messages=tuple(wire.Message(r, c) for r, c in job.messages) if job.model else (),
            prompt=(job.prompt or "") if job.model else "",  # raw text: tokenized there
            model=job.model,
            tokens=tokens,
            sampling=wire.Sampling(max_tokens=s.max_tokens, temperature=float(s.temperature),
                                   top_p=float(s.top_p), seed=s.seed),
            deadline=deadline,
            hop_budget=self.hop_budget,
            grammar=job.grammar,
            logprobs=job.logprobs,
        ))
        if job.model:  # its text travels: a frame over the wire's limits is refused here
            try:
                wire.encode_frame(req)
            except wire.WireError as exc:
                raise BadRequest(f"the prompt is too large to pass to a node of its model: "
                                 f"{exc}", code="context_length_exceeded") from None
        send, recv = trio.open_memory_channel[Any](_EVENT_BUFFER)
        t_recv = self.infer.clock()  # the service's one clock (overlay/infer.py)

        async def pipeline() -> None:
            async with send:
                try:
                    await self.infer.process(req, send.send, t_recv)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # the HTTP side left
                except Exception as exc:
                    log.exception("request pipeline failed")
                    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                        await send.send(wire.Error("internal", f"gateway: {exc}"[:500]))

        raised: Exception | None = None
        async with recv, trio.open_nursery() as nursery:
            nursery.start_soon(pipeline)
            events = _FrameEvents(len(tokens), recv)
            try:
                yield events
            except Exception as exc:  # re-raised below, outside the nursery (no group)
                raised = exc
            if events.answered and raised is None:
                # let the pipeline read END and close its streams cleanly (bounded)
                with trio.move_on_after(1.0):
                    async for _ in recv:
                        pass
            nursery.cancel_scope.cancel()
        if raised is not None:
            raise raised


def default_model_ids(backend) -> list[str]:
    """The model's name (``core/models.model_name_from_path``: the file name without
    ``.gguf``, e.g. ``SmolLM2-135M-Instruct.Q4_1``), and the alias ``prefixmesh`` (the
    node's own model, whatever it is)."""
    from prefixmesh.overlay.core.models import LOCAL_ALIAS, model_name_from_path

    return [model_name_from_path(getattr(backend, "model_path", None),
                                 bytes(backend.model_fingerprint)), LOCAL_ALIAS]


#: tenants derived for other models' requests (namespace keys per model): a few per model
_MAX_FOREIGN_TENANTS = 256


# --- serving ------------------------------------------------------------------------------


async def serve_http(backend: GatewayBackend, settings: GatewaySettings, *,
                     task_status=trio.TASK_STATUS_IGNORED, api: bool = True,
                     what: str = "HTTP gateway") -> None:
    """Serve the gateway until cancelled; ``task_status.started(url)`` once bound
    (``http://HOST:PORT`` with the actual port when ``listen`` asked for port 0)."""
    try:
        from hypercorn.config import Config as HypercornConfig
        from hypercorn.trio import serve
    except ImportError:
        raise GatewayConfigError("the HTTP gateway needs the 'hypercorn' package "
                                 "(pip install hypercorn)") from None

    check_bind(settings)
    hc = HypercornConfig()
    hc.bind = [settings.listen]
    hc.accesslog = None
    hc.include_server_header = False
    hc.keep_alive_timeout = 30.0
    hc.graceful_timeout = 2.0
    hc.h11_max_incomplete_size = 16 * 1024
    hc.errorlog = logging.getLogger("prefixmesh.http.server")
    app = GatewayApp(backend, settings, api=api)
    bound: list[str] = []

    class _Status:  # hypercorn reports its bound addresses here
        def started(self, binds=None) -> None:
            bound.append(binds[0] if binds else f"http://{settings.listen}")
            log.info("%s on %s", what, bound[0])
            task_status.started(bound[0])

    try:
        await serve(app, hc, task_status=_Status())
    except (OSError, BaseExceptionGroup) as exc:
        cause = _leaf_oserror(exc)
        if bound or cause is None:
            raise
        raise GatewayConfigError(f'{what} cannot listen on "{settings.listen}": '
                                 f"{cause.strerror or cause}") from None


def _leaf_oserror(exc: BaseException) -> OSError | None:
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            found = _leaf_oserror(sub)
            if found is not None:
                return found
    return None


def node_metrics(node):
    """``node.metrics`` (created here if the daemon made none), registered as an observer of
    the node's requests (``InferService``'s ``ObserverFanout``) once."""
    from prefixmesh.overlay.events import ObserverFanout

    from .metrics import NodeMetrics

    metrics = getattr(node, "metrics", None)
    if metrics is None:
        metrics = node.metrics = NodeMetrics(node)
    for fanout in (getattr(node, "observers", None), getattr(node.infer, "observer", None)):
        if isinstance(fanout, ObserverFanout):
            if metrics not in fanout.observers:
                fanout.add(metrics)
            break
    return metrics


async def serve_node_http(node, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """The daemon's hook: serve the gateway of ``node`` (a ``node.daemon.Node``) when
    ``[http].listen`` is set, and the operator endpoints alone on ``[metrics].listen`` when
    that is set; ``task_status.started(url)`` once all are bound (the gateway's URL, else
    the metrics one, else None when neither is set: then it returns at once)."""
    cfg = node.config
    metrics_listen = getattr(getattr(cfg, "metrics", None), "listen", "") or ""
    if not cfg.http.listen and not metrics_listen:
        task_status.started(None)
        return
    settings = settings_from_config(cfg)
    backend = NodeGatewayBackend(infer=node.infer, backend=node.backend, tenants=node.tenants,
                                 hop_budget=cfg.routing.hop_budget, node=node,
                                 metrics=node_metrics(node))
    async with trio.open_nursery() as nursery:
        urls = []
        if cfg.http.listen:
            urls.append(await nursery.start(functools.partial(serve_http, backend, settings)))
        if metrics_listen:
            ops = dataclasses.replace(settings, listen=metrics_listen)
            urls.append(await nursery.start(functools.partial(
                serve_http, backend, ops, api=False, what="metrics and dashboard")))
        task_status.started(urls[0])
