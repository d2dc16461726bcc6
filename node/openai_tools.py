"""OpenAI tool calling and structured output for the gateway (pure: no IO, no clock).

Parsing (``tools``, ``tool_choice``, ``parallel_tool_calls``, ``response_format``, messages
with ``tool_calls`` and ``tool`` messages), rendering of tools into the prompt, the
llama.cpp grammars that constrain the output, and parsing of the model's output into
OpenAI ``tool_calls`` (whole answers and streams). The HTTP gateway
(:mod:`prefixmesh.node.http_gateway`) uses it through :mod:`.openai_schema`; errors are
:class:`ToolsError` (a 400 naming the parameter).

Rendering: the generic template
    A model whose own chat template (GGUF ``tokenizer.chat_template``) renders tools gets
    them through that template (:func:`native_chat` gives the messages and tools it is
    passed; ``inference/chat.py``, ``ChatRenderer.render_tools``); the default model
    (SmolLM2-135M-Instruct) has no such template, and the gateway renders tools with this
    generic, documented format (the widespread
    "Hermes" style that Qwen2.5 and others were trained on) into plain messages, which the
    model's template then renders as usual:

    * the tool definitions go at the end of the first system message (one is added when the
      conversation has none): :data:`TOOLS_HEADER`, one JSON line per tool
      (``{"type": "function", "function": {...}}`` as the client sent it), then
      :data:`TOOLS_FOOTER`. The definitions are the first thing in the prompt and do not
      depend on ``tool_choice``, so a second request with the same tools reuses their cached
      prefix;
    * an assistant message with ``tool_calls`` becomes an assistant message whose content
      (if any) is followed by one ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
      block per call;
    * ``tool`` messages become a user message of ``<tool_response>\\n...\\n</tool_response>``
      blocks (consecutive ones merged into one message).

Output: every ``<tool_call>...</tool_call>`` block whose JSON names a declared tool and
carries an object of arguments is a tool call; the rest of the text is the content. A
whole answer that is exactly such a JSON object (no tags) is a call too. With
``tool_choice`` ``"none"`` nothing is parsed.

Constraints (llama.cpp GBNF, generated with llama-cpp-python's JSON-schema converter):
``tool_choice`` ``"required"`` or a named function makes the output one tool-call block
(``"required"`` with ``parallel_tool_calls``, the default: up to
:data:`MAX_PARALLEL_CALLS`) whose arguments follow the function's ``parameters`` schema; ``response_format`` ``json_object`` any JSON object,
``json_schema`` that schema. The converter ignores some JSON-schema keywords silently
(``minimum``, ``not``, ...); :func:`check_schema` refuses every keyword outside
:data:`SCHEMA_KEYWORDS` so a constrained answer always validates against the schema it was
asked for. The grammar is generated here, at the entry node, travels in the REQUEST frame
(``wire.Request.grammar``) and is compiled and enforced by the serving node's llama.cpp.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ToolsError",
    "MAX_TOOLS",
    "MAX_PARALLEL_CALLS",
    "MAX_GRAMMAR_CHARS",
    "SCHEMA_KEYWORDS",
    "TOOLS_HEADER",
    "TOOLS_FOOTER",
    "Tool",
    "ToolCall",
    "Message",
    "ToolSpec",
    "ResponseFormat",
    "parse_tools",
    "parse_response_format",
    "parse_message",
    "render_messages",
    "native_chat",
    "check_schema",
    "tool_grammar",
    "format_grammar",
    "parse_tool_calls",
    "ToolStreamParser",
]


class ToolsError(ValueError):
    """A request's tools, tool messages or response format are invalid, or cannot be
    enforced: the gateway answers 400 with ``param`` and ``code`` (openai_schema turns it
    into its ``BadRequest``; this module imports nothing of the gateway's)."""

    def __init__(self, message: str, *, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


BadRequest = ToolsError  # the name the checks below read best with


def json_type(v: Any) -> str:
    """How a JSON value is named in an error message (also the OpenAI schema checks')."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int | float):
        return "a number"
    if isinstance(v, str):
        return "a string"
    return "an array" if isinstance(v, list) else "an object"


def _bad_type(param: str, want: str, value: Any) -> ToolsError:
    return ToolsError(f"'{param}' must be {want}, not {json_type(value)}", param=param,
                      code="invalid_type")

MAX_TOOLS = 64
MAX_PARALLEL_CALLS = 4
MAX_GRAMMAR_CHARS = 64 * 1024  # = overlay.core.wire.MAX_GRAMMAR_CHARS
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"

#: JSON-schema keywords a constrained answer is guaranteed to satisfy (the converter
#: enforces them); annotations are accepted and have no effect on validity
SCHEMA_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems",
    "minItems", "maxItems", "enum", "const", "anyOf", "allOf", "$ref", "$defs",
    "definitions", "minLength", "maxLength", "pattern", "format",
    # annotations
    "title", "description", "default", "examples", "$schema", "$id", "$comment",
})
_FORMATS = frozenset({"date", "time", "date-time", "uuid"})
_TYPES = frozenset({"string", "number", "integer", "boolean", "null", "object", "array"})


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: Mapping[str, Any]  # a JSON schema ({"type": "object"} when not given)
    definition: Mapping[str, Any]  # the tool object as the client sent it (rendered)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class Message:
    role: str  # system | user | assistant | tool
    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


@dataclass(frozen=True)
class ToolSpec:
    tools: tuple[Tool, ...]
    choice: str = "auto"  # "auto" | "none" | "required" | "function"
    function: str | None = None  # the named function (choice "function")
    parallel: bool = True

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tools)

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "function")


@dataclass(frozen=True)
class ResponseFormat:
    kind: str  # "json_object" | "json_schema"
    schema: Mapping[str, Any] = field(default_factory=dict)
    name: str = ""
    strict: bool = False


# --- parsing ----------------------------------------------------------------------------


def _tool(v: Any, i: int) -> Tool:
    p = f"tools[{i}]"
    if not isinstance(v, dict):
        raise _bad_type(p, "an object", v)
    if v.get("type", "function") != "function":
        raise BadRequest(f"'{p}.type' must be \"function\"", param=f"{p}.type",
                         code="unsupported_value")
    fn = v.get("function")
    if not isinstance(fn, dict):
        raise _bad_type(f"{p}.function", "an object", fn)
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise BadRequest(f"'{p}.function.name' must be 1 to 64 letters, digits, '_' or '-'",
                         param=f"{p}.function.name", code="invalid_value")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise _bad_type(f"{p}.function.description", "a string", desc)
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise _bad_type(f"{p}.function.parameters", "an object", params)
    return Tool(name=name, description=desc, parameters=params,
                definition={"type": "function", "function": fn})


def parse_tools(obj: Mapping[str, Any]) -> ToolSpec | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat body (None: no
    tools). ``functions`` / ``function_call`` (the deprecated API) are refused."""
    for key in ("functions", "function_call"):
        if obj.get(key) not in (None, []):
            raise BadRequest(f"'{key}' is deprecated and not supported; use 'tools' and "
                             "'tool_choice'", param=key, code="unsupported_parameter")
    raw = obj.get("tools")
    choice_raw = obj.get("tool_choice")
    parallel = obj.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad_type("parallel_tool_calls", "a boolean", parallel)
    if raw in (None, []):
        if choice_raw not in (None, "none", "auto"):
            raise BadRequest("'tool_choice' needs 'tools'", param="tool_choice",
                             code="invalid_value")
        return None
    if not isinstance(raw, list):
        raise _bad_type("tools", "an array", raw)
    if len(raw) > MAX_TOOLS:
        raise BadRequest(f"'tools' has more than {MAX_TOOLS} entries", param="tools",
                         code="invalid_value")
    tools = tuple(_tool(t, i) for i, t in enumerate(raw))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise BadRequest("'tools' declares a function name twice", param="tools",
                         code="invalid_value")
    choice, function = "auto", None
    if isinstance(choice_raw, str):
        if choice_raw not in ("auto", "none", "required"):
            raise BadRequest("'tool_choice' must be \"auto\", \"none\", \"required\" or "
                             "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                             param="tool_choice", code="invalid_value")
        choice = choice_raw
    elif isinstance(choice_raw, dict):
        fn = choice_raw.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice_raw.get("type") != "function" or not isinstance(name, str):
            raise BadRequest("'tool_choice' object must be {\"type\": \"function\", "
                             "\"function\": {\"name\": ...}}", param="tool_choice",
                             code="invalid_value")
        if name not in names:
            raise BadRequest(f"'tool_choice' names {name!r}, which is not in 'tools'",
                             param="tool_choice", code="invalid_value")
        choice, function = "function", name
    elif choice_raw is not None:
        raise _bad_type("tool_choice", "a string or an object", choice_raw)
    return ToolSpec(tools=tools, choice=choice, function=function,
                    parallel=True if parallel is None else parallel)


def parse_response_format(obj: Mapping[str, Any]) -> ResponseFormat | None:
    """``response_format``: None for text; the schema is checked (:func:`check_schema`)."""
    rf = obj.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise _bad_type("response_format", "an object", rf)
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object", {"type": "object"})
    if kind != "json_schema":
        raise BadRequest("'response_format.type' must be text, json_object or json_schema",
                         param="response_format", code="unsupported_value")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise _bad_type("response_format.json_schema", "an object", js)
    name = js.get("name", "")
    if not isinstance(name, str):
        raise _bad_type("response_format.json_schema.name", "a string", name)
    schema = js.get("schema")
    if schema is None:
        schema = {"type": "object"}
    if not isinstance(schema, dict):
        raise _bad_type("response_format.json_schema.schema", "an object", schema)
    strict = js.get("strict", False)
    if strict is not None and not isinstance(strict, bool):
        raise _bad_type("response_format.json_schema.strict", "a boolean", strict)
    check_schema(schema, "response_format.json_schema.schema")
    return ResponseFormat("json_schema", schema, name, bool(strict))


def _text(v: Any, param: str) -> str:
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise _bad_type(param, "a string or an array of content parts", v)
    texts = []
    for j, part in enumerate(v):
        p = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise _bad_type(p, "an object", part)
        if part.get("type") != "text":
            raise BadRequest(f"'{p}': only text content parts are supported", param=p,
                             code="unsupported_value")
        text = part.get("text")
        if not isinstance(text, str):
            raise _bad_type(f"{p}.text", "a string", text)
        texts.append(text)
    return "".join(texts)


def _tool_calls(v: Any, i: int) -> tuple[ToolCall, ...]:
    p = f"messages[{i}].tool_calls"
    if not isinstance(v, list):
        raise _bad_type(p, "an array", v)
    out = []
    for j, c in enumerate(v):
        q = f"{p}[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict):
            raise _bad_type(f"{q}.function", "an object", fn)
        name, args = fn.get("name"), fn.get("arguments", "{}")
        if not isinstance(name, str) or not name:
            raise _bad_type(f"{q}.function.name", "a non-empty string", name)
        if not isinstance(args, str):
            raise _bad_type(f"{q}.function.arguments", "a string (JSON text)", args)
        cid = c.get("id", "")
        if not isinstance(cid, str):
            raise _bad_type(f"{q}.id", "a string", cid)
        out.append(ToolCall(cid, name, args))
    return tuple(out)


def parse_message(m: Any, i: int) -> Message:
    """One chat message; roles system, developer (= system), user, assistant, tool."""
    if not isinstance(m, dict):
        raise _bad_type(f"messages[{i}]", "an object", m)
    role = m.get("role")
    if not isinstance(role, str):
        raise _bad_type(f"messages[{i}].role", "a string", role)
    role = "system" if role == "developer" else role
    if role not in ("system", "user", "assistant", "tool"):
        raise BadRequest(
            f"'messages[{i}].role' must be one of system, developer, user, assistant, tool; "
            f"got {role!r}", param=f"messages[{i}].role", code="invalid_value")
    param = f"messages[{i}].content"
    raw = m.get("content")
    calls = _tool_calls(m["tool_calls"], i) if (
        role == "assistant" and m.get("tool_calls") not in (None, [])) else ()
    if raw is None and not calls:
        raise BadRequest(f"'{param}' is required", param=param,
                         code="missing_required_parameter")
    content = None if raw is None else _text(raw, param)
    call_id = None
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str):
            raise _bad_type(f"messages[{i}].tool_call_id", "a string", call_id)
    return Message(role, content, calls, call_id)


# --- rendering --------------------------------------------------------------------------


def _call_block(name: str, arguments: str) -> str:
    try:
        args: Any = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        args = arguments  # rendered as the string the client sent
    body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"{_OPEN}\n{body}\n{_CLOSE}"


def _tools_text(tools: Sequence[Tool]) -> str:
    lines = [json.dumps(t.definition, ensure_ascii=False) for t in tools]
    return "\n".join([TOOLS_HEADER, *lines, TOOLS_FOOTER])


def render_messages(messages: Sequence[Message], spec: ToolSpec | None
                    ) -> tuple[tuple[str, str], ...]:
    """Messages as (role, content) pairs for the model's template, tools rendered with the
    generic format (see the module docstring). Without tools and tool messages this is
    just the messages' (role, content)."""
    out: list[list[str]] = []
    for m in messages:
        if m.role == "tool":
            block = f"<tool_response>\n{m.content or ''}\n</tool_response>"
            if out and out[-1][0] == "user" and out[-1][1].startswith("<tool_response>"):
                out[-1][1] += "\n" + block
            else:
                out.append(["user", block])
        elif m.tool_calls:
            parts = [m.content] if m.content else []
            parts += [_call_block(c.name, c.arguments) for c in m.tool_calls]
            out.append(["assistant", "\n".join(parts)])
        else:
            out.append([m.role, m.content or ""])
    if spec is not None and spec.tools:
        tools = _tools_text(spec.tools)
        if out and out[0][0] == "system":
            out[0][1] = f"{out[0][1]}\n\n{tools}" if out[0][1] else tools
        else:
            out.insert(0, ["system", tools])
    return tuple((r, c) for r, c in out)


def native_chat(messages: Sequence[Message], spec: ToolSpec | None
                ) -> tuple[tuple[dict[str, Any], ...], tuple[dict[str, Any], ...]] | None:
    """(messages, tools) for a model whose own template renders tools (OpenAI-shaped dicts;
    call arguments as objects, the Hugging Face convention), or None when the request has
    no tools and no tool messages (then the plain rendering is the same)."""
    has_tool_msgs = any(m.role == "tool" or m.tool_calls for m in messages)
    if spec is None and not has_tool_msgs:
        return None
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                try:
                    args: Any = json.loads(c.arguments) if c.arguments.strip() else {}
                except ValueError:
                    args = c.arguments
                calls.append({"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": args}})
            d["tool_calls"] = calls
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    tools = tuple(dict(t.definition) for t in spec.tools) if spec is not None else ()
    return tuple(out), tools


# --- schemas and grammars ---------------------------------------------------------------


def check_schema(schema: Any, param: str, depth: int = 0) -> None:
    """Refuse (400, naming the keyword and where) a schema a grammar cannot enforce."""
    if depth > 24:
        raise BadRequest(f"'{param}' nests too deeply", param=param, code="invalid_schema")
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise BadRequest(f"'{param}' must be a JSON schema object, not {json_type(schema)}",
                         param=param, code="invalid_schema")
    for key, v in schema.items():
        where = f"{param}.{key}"
        if key not in SCHEMA_KEYWORDS:
            raise BadRequest(f"JSON-schema keyword {key!r} at '{param}' cannot be enforced "
                             "by the grammar (supported: "
                             f"{', '.join(sorted(SCHEMA_KEYWORDS))})", param=param,
                             code="invalid_schema")
        if key == "type":
            types = v if isinstance(v, list) else [v]
            if not types or any(t not in _TYPES for t in types):
                raise BadRequest(f"'{where}' is not a JSON type (or list of types)",
                                 param=param, code="invalid_schema")
        elif key == "format" and v not in _FORMATS:
            raise BadRequest(f"'{where}': format {v!r} is not supported (supported: "
                             f"{', '.join(sorted(_FORMATS))})", param=param,
                             code="invalid_schema")
        elif key == "$ref" and not (isinstance(v, str) and v.startswith("#/")):
            raise BadRequest(f"'{where}': only local references (\"#/...\") are supported",
                             param=param, code="invalid_schema")
        elif key in ("properties", "$defs", "definitions"):
            if not isinstance(v, dict):
                raise _bad_type(where, "an object", v)
            for name, sub in v.items():
                check_schema(sub, f"{where}.{name}", depth + 1)
        elif key in ("items", "additionalProperties") and not isinstance(v, bool):
            check_schema(v, where, depth + 1)
        elif key in ("anyOf", "allOf", "prefixItems"):
            if not isinstance(v, list) or not v:
                raise _bad_type(where, "a non-empty array", v)
            for j, sub in enumerate(v):
                check_schema(sub, f"{where}[{j}]", depth + 1)
        elif key == "enum" and (not isinstance(v, list) or not v):
            raise _bad_type(where, "a non-empty array", v)


def _converter():
    from llama_cpp.llama_grammar import SchemaConverter

    return SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)


def _finish(conv, rules: Iterable[tuple[str, str]], param: str) -> str:
    for name, rule in rules:
        conv._rules[name] = rule
    text = conv.format_grammar()
    if len(text) > MAX_GRAMMAR_CHARS:
        raise BadRequest(f"the grammar for '{param}' has {len(text)} characters, more than "
                         f"{MAX_GRAMMAR_CHARS}", param=param, code="invalid_schema")
    return text


def _visit(conv, schema: Mapping[str, Any], name: str, param: str) -> str:
    try:
        resolved = conv.resolve_refs(json.loads(json.dumps(schema)), "input")
        return conv.visit(resolved, name)
    except BadRequest:
        raise
    except Exception as exc:  # the converter raises ValueError, AssertionError, KeyError
        raise BadRequest(f"'{param}' cannot be turned into a grammar: {exc}", param=param,
                         code="invalid_schema") from None


def format_grammar(rf: ResponseFormat) -> str:
    """The GBNF of a ``response_format`` (root: the JSON value, optional trailing space)."""
    conv = _converter()
    _visit(conv, rf.schema, "", "response_format")
    return _finish(conv, (), "response_format")


def tool_grammar(spec: ToolSpec) -> str:
    """The GBNF of a constrained tool choice: tool-call blocks (one, or up to
    MAX_PARALLEL_CALLS with ``parallel``) of the named function or any declared one."""
    tools = [t for t in spec.tools if spec.choice != "function" or t.name == spec.function]
    for i, t in enumerate(spec.tools):
        if t in tools:
            check_schema(t.parameters, f"tools[{i}].function.parameters")
    alts = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
             "properties": {"name": {"const": t.name}, "arguments": t.parameters}}
            for t in tools]
    conv = _converter()
    call = _visit(conv, alts[0] if len(alts) == 1 else {"anyOf": alts}, "call", "tools")
    block = f'"{_OPEN}\\n" {call} "\\n{_CLOSE}"'
    # a named function is called once; "required" with parallel_tool_calls allows more
    more = MAX_PARALLEL_CALLS - 1 if spec.parallel and spec.choice == "required" else 0
    root = "tool-call" + (f' ("\\n" tool-call){{0,{more}}}' if more else "")
    return _finish(conv, [("tool-call", block), ("root", root)], "tools")


# --- output parsing ---------------------------------------------------------------------


def _as_call(text: str, names: Sequence[str]) -> tuple[str, str] | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def parse_tool_calls(text: str, names: Sequence[str]
                     ) -> tuple[str | None, list[tuple[str, str]]]:
    """(content or None, [(name, arguments JSON)]) of a whole answer."""
    p = ToolStreamParser(names)
    events = p.feed(text) + p.finish()
    content = "".join(e[1] for e in events if e[0] == "content").strip()
    calls = [(e[1], e[2]) for e in events if e[0] == "call"]
    if not calls:
        whole = _as_call(text.strip(), names)
        if whole is not None:
            return None, [whole]
    return (content or None), calls


class ToolStreamParser:
    """Turns streamed answer text into ``("content", text)`` and ``("call", name, args)``
    events. Text that might be the start of ``<tool_call>`` is held back until decided;
    a block is buffered until ``</tool_call>`` (or the end); a block that is not a valid
    call of a declared tool is passed on as content."""

    def __init__(self, names: Sequence[str]):
        self.names = tuple(names)
        self._buf = ""
        self._in_call = False
        self._after_block = False  # newlines right after a block separate blocks
        self.calls = 0

    def feed(self, text: str) -> list[tuple]:
        self._buf += text
        out: list[tuple] = []
        while True:
            if self._after_block:
                self._buf = self._buf.lstrip("\n")
                if not self._buf:
                    return out
                self._after_block = False
            if self._in_call:
                end = self._buf.find(_CLOSE)
                if end < 0:
                    return out
                out.append(self._block(self._buf[:end], closed=True))
                self._buf = self._buf[end + len(_CLOSE):]
                self._in_call = False
                self._after_block = True
                continue
            start = self._buf.find(_OPEN)
            if start >= 0:
                if start:
                    out.append(("content", self._buf[:start]))
                self._buf = self._buf[start + len(_OPEN):]
                self._in_call = True
                continue
            keep = _partial(self._buf, _OPEN)
            if len(self._buf) > keep:
                out.append(("content", self._buf[: len(self._buf) - keep]))
                self._buf = self._buf[len(self._buf) - keep:]
            return out

    def finish(self) -> list[tuple]:
        rest, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            return [self._block(rest, closed=False)]
        return [("content", rest)] if rest else []

    def _block(self, body: str, *, closed: bool) -> tuple:
        call = _as_call(body.strip(), self.names)
        if call is None:
            return ("content", _OPEN + body + (_CLOSE if closed else ""))
        self.calls += 1
        return ("call", *call)


def _partial(buf: str, tag: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:n]):
            return n
    return 0
