"""The Ollama API on the gateway's listener: ``/api/chat``, ``/api/generate``, ``/api/tags``,
``/api/show``, ``/api/version``.

Many local tools (Open WebUI, editors' assistants, LangChain's ``ChatOllama``) speak Ollama's
API rather than OpenAI's. This module translates: an Ollama body becomes the same
validated request the OpenAI endpoints build (``openai_schema.parse_chat_request`` /
``parse_completion_request``: one set of limits and checks), runs through the same
``GatewayApp`` generation path (routing, caching, tenants, auth and capacity rules are
those of ``/v1``), and the answer goes back in Ollama's shapes: one JSON object, or
NDJSON lines when ``stream`` is true (Ollama's default). Errors are Ollama's
``{"error": "..."}`` with the same HTTP status the OpenAI endpoint would use.

``format`` (``"json"`` or a JSON schema) is structured output, enforced with a llama.cpp
grammar exactly as ``response_format`` on ``/v1`` (:mod:`.openai_tools`: the same schema
keywords, the same 400 for one a grammar cannot enforce).

What is refused with a 400 naming the field: ``tools``,
``images``, ``think``, generate's ``context``/``template``/``suffix``, and sampling options
that change the output and that the mesh does not implement (``top_k``, ``min_p``,
``repeat_penalty``, ... unless set to their neutral value). Runtime options that only
concern a local Ollama server (``num_ctx``, ``num_gpu``, ``keep_alive``, ...) are ignored:
the serving node decides those.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import trio

from .mesh_models import job_model, models_json
from .openai_schema import (
    ApiError,
    BadRequest,
    ChatRequest,
    CompletionRequest,
    MethodNotAllowed,
    NoCapacity,
    NotFound,
    Usage,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
)

__all__ = ["ROUTES", "handle", "parse_ollama_chat", "parse_ollama_generate", "OllamaRequest",
           "GatewayHooks"]

ROUTES = {"/api/chat": "POST", "/api/generate": "POST", "/api/tags": "GET",
          "/api/show": "POST", "/api/version": "GET"}
# Ollama's own sampling defaults (its docs' Modelfile table), so a client that sends no
# options gets the behaviour it would get from Ollama
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_P = 0.9
# options of a local Ollama server's runtime: meaningless for a mesh request, ignored
IGNORED_OPTIONS = frozenset({
    "num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "num_thread", "use_mmap",
    "use_mlock", "numa", "vocab_only", "num_keep", "keep_alive",
})
# sampling options we do not implement, with the value at which they change nothing
NEUTRAL_OPTIONS = {"top_k": 0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0,
                   "presence_penalty": 0.0, "frequency_penalty": 0.0, "repeat_last_n": 0,
                   "tfs_z": 1.0, "mirostat": 0, "penalize_newline": False}
_OPTION_TO_OPENAI = {"num_predict": "max_tokens", "temperature": "temperature",
                     "top_p": "top_p", "seed": "seed", "stop": "stop"}
_REFUSED_FIELDS = {"tools": "tool calling (tools) is not supported yet on /api/chat; use "
                            "/v1/chat/completions",
                   "think": "thinking mode (think) is not supported"}


@dataclass(frozen=True)
class GatewayHooks:
    """What this module needs of the gateway (``http_gateway.GatewayApp`` builds it), so
    the two modules do not import each other."""

    resolve_tenant: Callable[[], str]  # the gateway's tenant and API-key rules
    read_body: Callable[[], Awaitable[bytes]]  # bounded, with the body timeout
    run: Callable[..., Awaitable[Any]]  # GatewayApp's generation: (job, on_text) -> outcome
    send_json: Callable[..., Awaitable[None]]  # (send, status, obj)
    drain: Callable[[], Awaitable[None]]  # read and drop an unread body
    make_job: Callable[..., Any]  # GenerationJob(tenant=, sampling=, deadline_s=, ...)


@dataclass(frozen=True)
class OllamaRequest:
    kind: str  # "chat" | "generate"
    model: str  # as the client named it (echoed back)
    stream: bool
    openai: ChatRequest | CompletionRequest | None  # None: generate with an empty prompt
    grammar: str = ""  # the llama.cpp grammar of ``format`` ("" when absent)


def _canonical_model(name: str, model_ids: list[str]) -> str | None:
    """The mesh's model id for an Ollama model name (``NAME`` or ``NAME:latest``)."""
    if name in model_ids:
        return name
    if name.endswith(":latest") and name[: -len(":latest")] in model_ids:
        return name[: -len(":latest")]
    return None


def _mesh_ids(backend) -> list[str]:
    """Every model id ``GET /v1/models`` lists (this node's, then the mesh's others)."""
    return [m["id"] for m in models_json(backend)["data"]]


def _job_model(backend, name: str) -> bytes | None:
    """The fingerprint to ask for (b"": this node's model), None: nobody serves it."""
    for candidate in (name, name[: -len(":latest")] if name.endswith(":latest") else None):
        fp = job_model(backend, candidate) if candidate else None
        if fp is not None:
            return fp
    return None


def _options(obj: Mapping[str, Any]) -> dict[str, Any]:
    """Ollama ``options`` as OpenAI sampling fields (after refusing what we cannot honour)."""
    opts = obj.get("options")
    if opts is None:
        opts = {}
    if not isinstance(opts, dict):
        raise BadRequest("options must be an object", param="options")
    out: dict[str, Any] = {"temperature": DEFAULT_TEMPERATURE, "top_p": DEFAULT_TOP_P}
    for key, value in opts.items():
        if key in IGNORED_OPTIONS:
            continue
        if key in NEUTRAL_OPTIONS:
            if value is not None and value != NEUTRAL_OPTIONS[key]:
                raise BadRequest(f"options.{key} is not supported by this mesh (only its "
                                 f"neutral value {NEUTRAL_OPTIONS[key]!r})",
                                 param=f"options.{key}")
            continue
        if key not in _OPTION_TO_OPENAI:
            raise BadRequest(f"unknown option options.{key}", param=f"options.{key}")
        if key == "num_predict" and isinstance(value, int) and value < 0:
            continue  # -1 (no limit) / -2 (fill the context): the gateway's default
        out[_OPTION_TO_OPENAI[key]] = value
    return out


def format_grammar(obj: Mapping[str, Any]) -> str:
    """The grammar of Ollama's ``format`` ("json" or a JSON schema; "" when absent)."""
    from . import openai_tools

    fmt = obj.get("format")
    if fmt in (None, ""):
        return ""
    if fmt == "json":
        rf = {"type": "json_object"}
    elif isinstance(fmt, dict):
        rf = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    else:
        raise BadRequest('format must be "json" or a JSON schema object', param="format")
    try:
        spec = openai_tools.parse_response_format({"response_format": rf})
        return openai_tools.format_grammar(spec)
    except openai_tools.ToolsError as exc:
        raise BadRequest(exc.message.replace("response_format.json_schema.schema", "format"),
                         param="format") from None


def _refuse(obj: Mapping[str, Any], extra: Mapping[str, str] | None = None) -> None:
    for key, why in {**_REFUSED_FIELDS, **(extra or {})}.items():
        value = obj.get(key)
        if value not in (None, False, [], ""):
            raise BadRequest(why, param=key)


def _openai_param(exc: BadRequest) -> BadRequest:
    """Name the Ollama field in an error raised while validating the translated body."""
    back = {v: f"options.{k}" for k, v in _OPTION_TO_OPENAI.items()}
    param = back.get(exc.param or "", exc.param)
    message = exc.message
    if exc.param in back:
        message = message.replace(exc.param, param)
    return BadRequest(message, param=param)


def _messages(obj: Mapping[str, Any]) -> list[dict[str, Any]]:
    msgs = obj.get("messages")
    if not isinstance(msgs, list):
        raise BadRequest("messages must be an array", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if isinstance(m, dict):
            if m.get("images"):
                raise BadRequest("images are not supported (text models only)",
                                 param=f"messages[{i}].images")
            if m.get("tool_calls"):
                raise BadRequest("tool calls are not supported yet",
                                 param=f"messages[{i}].tool_calls")
            m = {k: v for k, v in m.items() if k in ("role", "content")}
        out.append(m)
    return out


def parse_ollama_chat(obj: Mapping[str, Any], *, default_max_tokens: int) -> OllamaRequest:
    model = obj.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model is required", param="model")
    _refuse(obj)
    stream = obj.get("stream", True)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", param="stream")
    body = {"model": model, "messages": _messages(obj), **_options(obj)}
    try:
        req = parse_chat_request(body, default_max_tokens=default_max_tokens)
    except BadRequest as exc:
        raise _openai_param(exc) from None
    return OllamaRequest("chat", model, stream, req, format_grammar(obj))


def parse_ollama_generate(obj: Mapping[str, Any], *, default_max_tokens: int) -> OllamaRequest:
    model = obj.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model is required", param="model")
    _refuse(obj, {"context": "context (token ids of an earlier answer) is not supported; "
                             "send the conversation to /api/chat instead",
                  "template": "a custom template is not supported (the model's own is used)",
                  "suffix": "fill-in-the-middle (suffix) is not supported",
                  "images": "images are not supported (text models only)"})
    stream = obj.get("stream", True)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", param="stream")
    prompt, system = obj.get("prompt", ""), obj.get("system")
    if not isinstance(prompt, str):
        raise BadRequest("prompt must be a string", param="prompt")
    if system is not None and not isinstance(system, str):
        raise BadRequest("system must be a string", param="system")
    if not prompt:  # Ollama answers an empty prompt by loading the model: nothing to run
        return OllamaRequest("generate", model, stream, None)
    sampling = _options(obj)
    try:
        if obj.get("raw") is True:
            req: ChatRequest | CompletionRequest = parse_completion_request(
                {"model": model, "prompt": prompt, **sampling},
                default_max_tokens=default_max_tokens)
        else:
            msgs = ([{"role": "system", "content": system}] if system else []) + \
                [{"role": "user", "content": prompt}]
            req = parse_chat_request({"model": model, "messages": msgs, **sampling},
                                     default_max_tokens=default_max_tokens)
    except BadRequest as exc:
        raise _openai_param(exc) from None
    return OllamaRequest("generate", model, stream, req, format_grammar(obj))


# --- response shapes ----------------------------------------------------------------------


def _iso(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts, _dt.UTC).isoformat().replace("+00:00", "Z")


def response_object(req: OllamaRequest, created: float, text: str, *, done: bool,
                    done_reason: str | None = None, usage: Usage | None = None,
                    ttft_s: float = 0.0, total_s: float = 0.0) -> dict[str, Any]:
    """One Ollama answer object (or NDJSON line); the final one carries the counts."""
    obj: dict[str, Any] = {"model": req.model, "created_at": _iso(created)}
    if req.kind == "chat":
        obj["message"] = {"role": "assistant", "content": text}
    else:
        obj["response"] = text
    obj["done"] = done
    if done:
        obj["done_reason"] = done_reason or "stop"
        u = usage or Usage(0, 0, 0)
        ns = 1_000_000_000
        obj.update({
            "total_duration": int(total_s * ns), "load_duration": 0,
            "prompt_eval_count": u.prompt_tokens, "prompt_eval_duration": int(ttft_s * ns),
            "eval_count": u.completion_tokens,
            "eval_duration": int(max(total_s - ttft_s, 0.0) * ns),
        })
    return obj


def model_details(model_id: str) -> dict[str, Any]:
    quant = model_id.rsplit(".", 1)[1] if "." in model_id else ""
    return {"format": "gguf", "family": "", "families": None, "parameter_size": "",
            "quantization_level": quant, "parent_model": ""}


def tags_object(model_ids: list[str], modified: float) -> dict[str, Any]:
    return {"models": [{"name": m, "model": m, "modified_at": _iso(modified), "size": 0,
                        "digest": "", "details": model_details(m)} for m in model_ids]}


# --- the handler --------------------------------------------------------------------------


async def handle(app, hooks: GatewayHooks, path: str, method: str, send) -> None:
    """Answer one ``/api/...`` request on ``app`` (a ``GatewayApp``); errors in Ollama's shape."""
    try:
        want = ROUTES.get(path)
        if want is None:
            await hooks.drain()
            raise NotFound(f"no such endpoint: {method} {path}")
        if method != want:
            await hooks.drain()
            raise MethodNotAllowed(f"{path} takes {want}, not {method}")
        if path == "/api/version":
            await hooks.send_json(send, 200, {"version": importlib.metadata.version("prefixmesh")})
            return
        tenant = hooks.resolve_tenant()
        model_ids = _mesh_ids(app.backend)
        if path == "/api/tags":
            await hooks.send_json(send, 200, tags_object(model_ids, app.clock()))
            return
        obj = parse_json_body(await hooks.read_body())
        if path == "/api/show":
            name = obj.get("model") or obj.get("name")
            model = _canonical_model(name, model_ids) if isinstance(name, str) else None
            if model is None:
                raise NotFound(f"model {name!r} not found")
            await hooks.send_json(send, 200, {
                "modelfile": "", "parameters": "", "template": "",
                "details": model_details(model), "model_info": {},
                "capabilities": ["completion"]})
            return
        await _generate(app, hooks, path, obj, tenant, model_ids, send)
    except ApiError as exc:
        app.stats["errors"] += 1
        if not getattr(send, "started", False):
            await hooks.send_json(send, exc.status, {"error": exc.message})


async def _generate(app, hooks: GatewayHooks, path: str, obj, tenant: str,
                    model_ids: list[str], send) -> None:
    s = app.settings
    parse = parse_ollama_chat if path == "/api/chat" else parse_ollama_generate
    req = parse(obj, default_max_tokens=s.default_max_tokens)
    fp = _job_model(app.backend, req.model)
    if fp is None:
        raise NotFound(f"model {req.model[:120]!r} not found: no node of the mesh serves it "
                       "now (see /api/tags)")
    created = app.clock()
    if req.openai is None:
        await hooks.send_json(send, 200, response_object(req, created, "", done=True,
                                                         done_reason="load"))
        return
    o = req.openai
    extra = {"messages": o.messages} if isinstance(o, ChatRequest) else {"prompt": o.prompt}
    if req.grammar:
        extra["grammar"] = req.grammar
    job = hooks.make_job(tenant=tenant, sampling=o.sampling, deadline_s=s.deadline_s,
                         model=fp, **extra)
    if app.active >= s.max_concurrent:
        raise NoCapacity(f"the gateway is serving {app.active} requests, its limit")
    app.active += 1
    try:
        await _run(hooks, req, job, created, send)
    finally:
        app.active -= 1


async def _run(hooks: GatewayHooks, req: OllamaRequest, job, created: float, send) -> None:
    t0 = trio.current_time()
    first = {"t": None}
    parts: list[str] = []
    started = {"sent": False}

    async def line(obj: Mapping[str, Any], more: bool) -> None:
        if not started["sent"]:
            started["sent"] = True
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"application/x-ndjson"), (b"cache-control", b"no-cache")]})
        await send({"type": "http.response.body", "more_body": more,
                    "body": json.dumps(obj, separators=(",", ":")).encode() + b"\n"})

    async def on_text(text: str) -> None:
        if first["t"] is None:
            first["t"] = trio.current_time()
        if req.stream:
            await line(response_object(req, created, text, done=False), True)
        else:
            parts.append(text)

    try:
        out = await hooks.run(job, on_text)
    except ApiError as exc:
        if not started["sent"]:
            raise
        await line({"error": exc.message}, False)  # mid-stream: Ollama's error line
        raise _Reported(exc.message) from exc
    total = trio.current_time() - t0
    ttft = (first["t"] - t0) if first["t"] is not None else total
    final = response_object(req, created, "" if req.stream else "".join(parts), done=True,
                            done_reason=out.finish_reason, usage=out.usage, ttft_s=ttft,
                            total_s=total)
    if req.stream:
        await line(final, False)
    else:
        await hooks.send_json(send, 200, final)


class _Reported(ApiError):
    """An error already sent as the stream's last line (counted, not answered again)."""
