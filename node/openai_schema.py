"""OpenAI-compatible request validation and response shapes (pure: no IO, no clock).

The HTTP gateway (:mod:`prefixmesh.node.http_gateway`) parses every request body with
this module and builds every response object with it, so the whole wire contract with
OpenAI clients is here and testable without a server.

Validation is strict about what we act on and lenient about what we ignore:

* the body must be a JSON object (UTF-8, at most :data:`MAX_BODY_BYTES`, the gateway
  enforces the size while reading) and nested at most :data:`MAX_JSON_DEPTH` levels;
* ``model`` (string) and ``messages`` / ``prompt`` are required; roles are ``system``,
  ``developer`` (treated as ``system``), ``user``, ``assistant`` (with ``tool_calls``, then
  its content may be null) and ``tool`` (with ``tool_call_id``); content is a string or a
  list of ``{"type": "text", "text": ...}`` parts; a completion's ``prompt`` is text or
  one prompt of token ids;
* tools (``tools``, ``tool_choice``, ``parallel_tool_calls``) and structured output
  (``response_format`` ``json_object`` / ``json_schema``) are parsed by
  :mod:`.openai_tools`, which also renders tools into the prompt; ``logprobs`` (chat: a
  boolean with ``top_logprobs`` 0..20; completions: an integer 0..20) asks for each
  token's log probability;
* sampling: ``max_tokens`` / ``max_completion_tokens`` (1..:data:`MAX_MAX_TOKENS`),
  ``temperature`` (0..2), ``top_p`` (0..1), ``seed`` (0..2**32-1), ``stop`` (a string or a
  list of at most :data:`MAX_STOP_SEQUENCES` non-empty strings of at most
  :data:`MAX_STOP_CHARS` characters each); ``n`` must be 1;
* features we do not implement are refused with 400 naming the parameter instead of
  silently ignored when ignoring them would change the answer (``n`` > 1, ``functions`` /
  ``function_call`` (use ``tools``), ``echo``, ``suffix``, ``best_of`` > 1, a JSON schema
  keyword a grammar cannot enforce);
* other keys (``user``, ``frequency_penalty``, ``metadata``, ...) are ignored, as many
  OpenAI-compatible servers do, so that existing clients keep working;
* ``null`` counts as absent for optional keys.

Every failure is an :class:`ApiError` subclass carrying the HTTP status and the OpenAI
error JSON shape ``{"error": {"message", "type", "param", "code"}}``.

:class:`StopScanner` implements stop sequences on a text stream: it holds back the
shortest tail that could still become a stop sequence, so no part of a stop sequence is
ever emitted, whatever the chunking.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .openai_tools import json_type

__all__ = [
    "MAX_BODY_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_MAX_TOKENS",
    "MAX_MESSAGES",
    "MAX_STOP_SEQUENCES",
    "MAX_STOP_CHARS",
    "MAX_SEED",
    "ApiError",
    "BadRequest",
    "Unauthorized",
    "PermissionDenied",
    "NotFound",
    "MethodNotAllowed",
    "PayloadTooLarge",
    "InternalError",
    "UpstreamError",
    "NoCapacity",
    "DeadlineExceeded",
    "SamplingOptions",
    "ChatRequest",
    "CompletionRequest",
    "Usage",
    "parse_json_body",
    "bad_request",
    "parse_chat_request",
    "parse_completion_request",
    "usage_object",
    "chat_completion_object",
    "chat_logprobs",
    "completion_logprobs",
    "tool_calls_object",
    "chat_chunk_object",
    "completion_object",
    "completion_chunk_object",
    "models_object",
    "catalog_models_object",
    "sse_event",
    "SSE_DONE",
    "StopScanner",
]

#: largest request body the gateway reads (bytes); larger bodies get 413
MAX_BODY_BYTES = 1024 * 1024
#: deepest JSON nesting accepted (objects + arrays); deeper bodies get 400
MAX_JSON_DEPTH = 32
#: largest max_tokens (the overlay's wire limit, overlay.wire.MAX_MAX_TOKENS)
MAX_MAX_TOKENS = 32_768
#: most chat messages (the overlay's wire limit, overlay.wire.MAX_MESSAGES)
MAX_MESSAGES = 256
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256
MAX_SEED = 0xFFFFFFFF
MAX_TEMPERATURE = 2.0
MAX_TOP_LOGPROBS = 20  # overlay.core.wire.MAX_TOP_LOGPROBS

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


# --- errors -----------------------------------------------------------------------------


class ApiError(Exception):
    """An error answered to the HTTP client as OpenAI error JSON with ``status``."""

    status = 500
    type = "server_error"
    default_code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class BadRequest(ApiError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(ApiError):
    status = 401
    type = "invalid_request_error"
    default_code = "invalid_api_key"


class PermissionDenied(ApiError):
    status = 403
    type = "permission_error"
    default_code = "tenant_not_allowed"


class NotFound(ApiError):
    status = 404
    type = "invalid_request_error"
    default_code = "not_found"


class MethodNotAllowed(ApiError):
    status = 405
    type = "invalid_request_error"
    default_code = "method_not_allowed"


class PayloadTooLarge(ApiError):
    status = 413
    type = "invalid_request_error"
    default_code = "request_too_large"


class InternalError(ApiError):
    status = 500
    type = "server_error"
    default_code = "internal_error"


class UpstreamError(ApiError):
    status = 502
    type = "server_error"
    default_code = "upstream_failed"


class NoCapacity(ApiError):
    status = 503
    type = "server_error"
    default_code = "no_capacity"


class DeadlineExceeded(ApiError):
    status = 504
    type = "server_error"
    default_code = "deadline_exceeded"


# --- requests ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingOptions:
    max_tokens: int
    temperature: float = 1.0  # OpenAI's default
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class ChatRequest:
    model: str
    # (role, content) for the model's template; roles normalised, tools and tool messages
    # rendered (openai_tools.render_messages)
    messages: tuple[tuple[str, str], ...]
    sampling: SamplingOptions
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    tools: Any = None  # openai_tools.ToolSpec | None
    response_format: Any = None  # openai_tools.ResponseFormat | None (None: text)
    logprobs: int = -1  # -1: none; else top_logprobs (0..MAX_TOP_LOGPROBS)
    # (messages, tools) as OpenAI dicts for a model whose own template renders tools
    # (openai_tools.native_chat); None without tools and tool messages
    tool_chat: Any = None


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompt: str | tuple[int, ...]  # raw text, or token ids of the model's vocabulary
    sampling: SamplingOptions
    stream: bool = False
    include_usage: bool = False
    logprobs: int = -1  # -1: none; else how many alternatives per token


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


def _depth_ok(raw: str) -> bool:
    """Whether the JSON text nests at most MAX_JSON_DEPTH levels (brackets outside strings).

    Checked before ``json.loads`` so that a deeply nested body cannot reach Python's
    recursion limit."""
    depth = 0
    in_string = False
    escaped = False
    for ch in raw:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; :class:`BadRequest` otherwise."""
    if len(raw) > MAX_BODY_BYTES:
        raise PayloadTooLarge(f"request body is larger than {MAX_BODY_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"request body is not UTF-8 ({exc.reason} at byte {exc.start})",
                         code="invalid_json") from None
    if not text.strip():
        raise BadRequest("request body is empty; expected a JSON object", code="invalid_json")
    if not _depth_ok(text):
        raise BadRequest(f"JSON nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise BadRequest(f"request body must be a JSON object, not {json_type(obj)}",
                         code="invalid_json")
    return obj


def _get(obj: Mapping[str, Any], key: str) -> Any:
    """The value of an optional key; null counts as absent."""
    return obj.get(key)


def _bad_type(param: str, want: str, value: Any) -> BadRequest:
    return BadRequest(f"'{param}' must be {want}, not {json_type(value)}", param=param,
                      code="invalid_type")


def _string(obj: Mapping[str, Any], key: str, *, required: bool = False) -> str | None:
    v = _get(obj, key)
    if v is None:
        if required:
            raise BadRequest(f"'{key}' is required", param=key, code="missing_required_parameter")
        return None
    if not isinstance(v, str):
        raise _bad_type(key, "a string", v)
    return v


def _bool(obj: Mapping[str, Any], key: str, default: bool = False) -> bool:
    v = _get(obj, key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad_type(key, "a boolean", v)
    return v


def _int_in(obj: Mapping[str, Any], key: str, lo: int, hi: int) -> int | None:
    v = _get(obj, key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        # 5.0 is accepted as 5 only when integral (some clients serialise ints as floats)
        if isinstance(v, float) and math.isfinite(v) and v.is_integer():
            v = int(v)
        else:
            raise _bad_type(key, "an integer", v)
    if not lo <= v <= hi:
        raise BadRequest(f"'{key}' must be between {lo} and {hi}, got {v}", param=key,
                         code="invalid_value")
    return v


def _float_in(obj: Mapping[str, Any], key: str, lo: float, hi: float) -> float | None:
    v = _get(obj, key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _bad_type(key, "a number", v)
    v = float(v)
    if not (math.isfinite(v) and lo <= v <= hi):
        raise BadRequest(f"'{key}' must be between {lo:g} and {hi:g}, got {v:g}", param=key,
                         code="invalid_value")
    return v


def _stop(obj: Mapping[str, Any]) -> tuple[str, ...]:
    v = _get(obj, "stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list):
        raise _bad_type("stop", "a string or an array of strings", v)
    if len(items) > MAX_STOP_SEQUENCES:
        raise BadRequest(f"'stop' has more than {MAX_STOP_SEQUENCES} sequences", param="stop",
                         code="invalid_value")
    out: list[str] = []
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise _bad_type(f"stop[{i}]", "a string", s)
        if not s or len(s) > MAX_STOP_CHARS:
            raise BadRequest(f"'stop[{i}]' must be 1 to {MAX_STOP_CHARS} characters",
                             param="stop", code="invalid_value")
        if s not in out:
            out.append(s)
    return tuple(out)


def _refuse_unsupported(obj: Mapping[str, Any], *, chat: bool) -> None:
    n = _int_in(obj, "n", 1, 1_000_000)
    if n is not None and n != 1:
        raise BadRequest("'n' must be 1 (one choice per request)", param="n",
                         code="unsupported_value")
    if not chat:
        if _bool(obj, "echo"):
            raise BadRequest("'echo' is not supported", param="echo",
                             code="unsupported_parameter")
        if _string(obj, "suffix"):
            raise BadRequest("'suffix' is not supported", param="suffix",
                             code="unsupported_parameter")
        best_of = _int_in(obj, "best_of", 1, 1_000_000)
        if best_of is not None and best_of != 1:
            raise BadRequest("'best_of' must be 1", param="best_of", code="unsupported_value")


def _logprobs(obj: Mapping[str, Any], *, chat: bool) -> int:
    """-1 (no logprobs) or how many alternatives per token to report."""
    if not chat:
        n = _int_in(obj, "logprobs", 0, MAX_TOP_LOGPROBS)
        return -1 if n is None else n
    want = _bool(obj, "logprobs")
    top = _int_in(obj, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not want:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs",
                         code="invalid_value")
    return (top or 0) if want else -1


def _sampling(obj: Mapping[str, Any], default_max_tokens: int) -> SamplingOptions:
    max_tokens = _int_in(obj, "max_completion_tokens", 1, MAX_MAX_TOKENS)
    if max_tokens is None:
        max_tokens = _int_in(obj, "max_tokens", 1, MAX_MAX_TOKENS)
    temperature = _float_in(obj, "temperature", 0.0, MAX_TEMPERATURE)
    top_p = _float_in(obj, "top_p", 0.0, 1.0)
    seed = _int_in(obj, "seed", 0, MAX_SEED)
    return SamplingOptions(
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        seed=0 if seed is None else seed,
        stop=_stop(obj),
    )


def _stream_flags(obj: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = _bool(obj, "stream")
    opts = _get(obj, "stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise _bad_type("stream_options", "an object", opts)
        if not stream:
            raise BadRequest("'stream_options' is only allowed when 'stream' is true",
                             param="stream_options", code="invalid_value")
        iu = opts.get("include_usage")
        if iu is not None and not isinstance(iu, bool):
            raise _bad_type("stream_options.include_usage", "a boolean", iu)
        include_usage = bool(iu)
    return stream, include_usage


def parse_chat_request(obj: Mapping[str, Any], *, default_max_tokens: int) -> ChatRequest:
    """A ``POST /v1/chat/completions`` body; :class:`BadRequest` says what is wrong."""
    model = _string(obj, "model", required=True)
    raw_messages = obj.get("messages")
    if raw_messages is None:
        raise BadRequest("'messages' is required", param="messages",
                         code="missing_required_parameter")
    if not isinstance(raw_messages, list):
        raise _bad_type("messages", "an array", raw_messages)
    if not raw_messages:
        raise BadRequest("'messages' must not be empty", param="messages", code="invalid_value")
    if len(raw_messages) > MAX_MESSAGES:
        raise BadRequest(f"'messages' has more than {MAX_MESSAGES} entries", param="messages",
                         code="invalid_value")
    from . import openai_tools

    try:
        msgs = [openai_tools.parse_message(m, i) for i, m in enumerate(raw_messages)]
        _refuse_unsupported(obj, chat=True)
        tools = openai_tools.parse_tools(obj)
        rf = openai_tools.parse_response_format(obj)
    except openai_tools.ToolsError as exc:
        raise bad_request(exc) from None
    if rf is not None and tools is not None and tools.constrained:
        raise BadRequest("'response_format' cannot be combined with a 'tool_choice' that "
                         "forces a tool call", param="response_format", code="invalid_value")
    stream, include_usage = _stream_flags(obj)
    assert model is not None
    return ChatRequest(model=model, messages=openai_tools.render_messages(msgs, tools),
                       sampling=_sampling(obj, default_max_tokens), stream=stream,
                       include_usage=include_usage, tools=tools, response_format=rf,
                       logprobs=_logprobs(obj, chat=True),
                       tool_chat=openai_tools.native_chat(msgs, tools))


def bad_request(exc: Any) -> BadRequest:
    """The :class:`BadRequest` of an ``openai_tools.ToolsError``."""
    return BadRequest(exc.message, param=exc.param, code=exc.code)


def parse_completion_request(obj: Mapping[str, Any], *, default_max_tokens: int
                             ) -> CompletionRequest:
    """A ``POST /v1/completions`` body. ``prompt`` is one string (or a one-string array),
    or one prompt of token ids (an array of integers, or an array holding one such array):
    the OpenAI forms of a single prompt. Token ids are used as they are (no BOS added);
    that they are in the model's vocabulary is checked where the model is known."""
    model = _string(obj, "model", required=True)
    prompt = obj.get("prompt")
    if prompt is None:
        raise BadRequest("'prompt' is required", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, list):
        if not all(type(t) is int for t in prompt):  # bool is an int, not a token id
            raise BadRequest("'prompt' must be a string or one prompt of token ids (an array "
                             "of integers); a batch of several prompts is not supported",
                             param="prompt", code="unsupported_value")
        if any(t < 0 for t in prompt):
            raise BadRequest("token ids in 'prompt' must not be negative", param="prompt",
                             code="invalid_value")
        prompt = tuple(prompt)
    elif not isinstance(prompt, str):
        raise _bad_type("prompt", "a string or an array of token ids", prompt)
    if not prompt:
        raise BadRequest("'prompt' must not be empty", param="prompt", code="invalid_value")
    _refuse_unsupported(obj, chat=False)
    stream, include_usage = _stream_flags(obj)
    assert model is not None
    return CompletionRequest(model=model, prompt=prompt,
                             sampling=_sampling(obj, default_max_tokens), stream=stream,
                             include_usage=include_usage, logprobs=_logprobs(obj, chat=False))


# --- responses --------------------------------------------------------------------------


def usage_object(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _with_ext(obj: dict[str, Any], ext: Mapping[str, Any] | None) -> dict[str, Any]:
    if ext is not None:
        obj["prefixmesh"] = dict(ext)
    return obj


def _token_text(piece: bytes) -> str:
    return piece.decode("utf-8", "replace")


def chat_logprobs(entries: Sequence[Any]) -> dict[str, Any]:
    """The ``logprobs`` object of a chat choice from per-token entries (anything with
    ``piece`` bytes, ``logprob`` and ``top`` [(bytes, logprob)], e.g. wire.TokenLogprob)."""
    return {"content": [{
        "token": _token_text(e.piece), "logprob": e.logprob, "bytes": list(e.piece),
        "top_logprobs": [{"token": _token_text(b), "logprob": lp, "bytes": list(b)}
                         for b, lp in e.top],
    } for e in entries], "refusal": None}


def completion_logprobs(entries: Sequence[Any], offset: int = 0) -> dict[str, Any]:
    """The legacy ``logprobs`` object of a completion choice (text offsets from ``offset``)."""
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        t = _token_text(e.piece)
        tokens.append(t)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{_token_text(b): lp for b, lp in e.top} for e in entries],
            "text_offset": offsets}


def tool_calls_object(calls: Sequence[Any]) -> list[dict[str, Any]]:
    """``message.tool_calls`` from (id, name, arguments) items (openai_tools.ToolCall)."""
    return [{"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def chat_completion_object(*, id: str, created: int, model: str, text: str | None,
                           finish_reason: str, usage: Usage,
                           ext: Mapping[str, Any] | None = None,
                           tool_calls: Sequence[Any] = (),
                           logprobs: Sequence[Any] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls_object(tool_calls)
    return _with_ext({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": None if logprobs is None else chat_logprobs(logprobs),
            "finish_reason": finish_reason,
        }],
        "usage": usage_object(usage),
    }, ext)


def chat_chunk_object(*, id: str, created: int, model: str, delta: Mapping[str, Any] | None,
                      finish_reason: str | None = None, usage: Usage | None = None,
                      include_usage_field: bool = False,
                      ext: Mapping[str, Any] | None = None,
                      logprobs: Sequence[Any] | None = None) -> dict[str, Any]:
    """One ``chat.completion.chunk``. ``delta=None`` makes the usage chunk (no choices)."""
    obj: dict[str, Any] = {
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [] if delta is None else [{
            "index": 0, "delta": dict(delta),
            "logprobs": None if logprobs is None else chat_logprobs(logprobs),
            "finish_reason": finish_reason,
        }],
    }
    if usage is not None:
        obj["usage"] = usage_object(usage)
    elif include_usage_field:
        obj["usage"] = None
    return _with_ext(obj, ext)


def completion_object(*, id: str, created: int, model: str, text: str, finish_reason: str,
                      usage: Usage, ext: Mapping[str, Any] | None = None,
                      logprobs: Sequence[Any] | None = None) -> dict[str, Any]:
    return _with_ext({
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text,
                     "logprobs": None if logprobs is None else completion_logprobs(logprobs),
                     "finish_reason": finish_reason}],
        "usage": usage_object(usage),
    }, ext)


def completion_chunk_object(*, id: str, created: int, model: str, text: str | None,
                            finish_reason: str | None = None, usage: Usage | None = None,
                            ext: Mapping[str, Any] | None = None,
                            logprobs: Sequence[Any] | None = None,
                            text_offset: int = 0) -> dict[str, Any]:
    """One streamed ``text_completion`` event; ``text=None`` makes the usage chunk."""
    lp = None if logprobs is None else completion_logprobs(logprobs, text_offset)
    obj: dict[str, Any] = {
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [] if text is None else [{"index": 0, "text": text, "logprobs": lp,
                                             "finish_reason": finish_reason}],
    }
    if usage is not None:
        obj["usage"] = usage_object(usage)
    return _with_ext(obj, ext)


def models_object(model_ids: Sequence[str], *, created: int = 0,
                  owned_by: str = "prefixmesh") -> dict[str, Any]:
    return {"object": "list", "data": [
        {"id": m, "object": "model", "created": created, "owned_by": owned_by}
        for m in model_ids
    ]}


def catalog_models_object(rows: Sequence[tuple[str, str, int, bool]], *, created: int = 0,
                          owned_by: str = "prefixmesh") -> dict[str, Any]:
    """``GET /v1/models`` of a mesh: one object per (id, fingerprint hex, nodes, local) row,
    OpenAI's fields plus ``prefixmesh`` (the fingerprint, how many nodes serve the model
    now, whether this node does), which standard clients ignore."""
    return {"object": "list", "data": [
        {"id": m, "object": "model", "created": created, "owned_by": owned_by,
         "prefixmesh": {"fingerprint": fp, "nodes": nodes, "local": local}}
        for m, fp, nodes, local in rows
    ]}


def sse_event(obj: Mapping[str, Any]) -> bytes:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() \
        + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


# --- stop sequences ---------------------------------------------------------------------


@dataclass
class StopScanner:
    """Cut a text stream at the first occurrence of any stop sequence.

    ``feed(chunk)`` returns the text that is safe to emit now: text that can no longer
    become part of a stop sequence. The shortest tail that is a proper prefix of some stop
    sequence is held back until the next chunk decides it. After a stop sequence is seen,
    :attr:`stopped` is true and everything from the stop sequence on is dropped.
    ``flush()`` (at the end of the stream) returns the held-back tail.

    The cut is where the first stop sequence to be *completed* starts (ties: the one that
    starts first), as a generator stopping at the first complete stop sequence would cut.

    Invariant (tested with hypothesis): for any text and any split into chunks, the
    concatenated output is the same: ``text`` up to that cut (or all of ``text`` when no
    stop sequence occurs), and nothing emitted is ever retracted.
    """

    stops: tuple[str, ...]
    stopped: bool = False
    _held: str = field(default="", repr=False)

    def feed(self, chunk: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return chunk
        buf = self._held + chunk
        # the stop sequence that is *completed* first (as a generator would see it, token by
        # token) wins; ties in completion go to the one that starts first. This makes the
        # result independent of how the stream is chunked.
        hits = [(i + len(s), i) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            cut = min(hits)[1]
            self.stopped = True
            self._held = ""
            return buf[:cut]
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
