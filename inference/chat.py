"""Chat rendering: OpenAI-style messages -> the model's own prompt text -> token ids.

The prompt is rendered with the model's chat template (GGUF ``tokenizer.chat_template``)
through a sandboxed jinja2 environment set up as llama-cpp-python's ``Jinja2ChatFormatter``
does (trim_blocks, lstrip_blocks, loop controls, ``raise_exception``, ``strftime_now``), and
the whole rendered text is tokenized ONCE with special tokens parsed and no extra BOS (a BOS
is prepended only when the model asks for one and the template did not render it).

Message boundaries. A cache point inside the prompt is only useful where the token ids of
the prompt begin with the token ids of the rendered prefix, i.e. where
``tokens(prefix + rest) == tokens(prefix) + tokens(rest)``. That holds at rendered message
boundaries for ordinary templates but is not guaranteed (a template may merge text across
messages, a tokenizer may merge across the seam), so :func:`render_chat` verifies it for
every boundary of every request and keeps only the boundaries where it holds.

Tools. A template that refers to a ``tools`` variable (:attr:`ChatRenderer.supports_tools`,
found from the template's syntax tree) renders tool definitions and the tool-calling
conversation itself: :meth:`ChatRenderer.render_tools` passes ``tools`` (OpenAI tool
objects) and messages that may carry ``tool_calls`` (arguments as objects, the Hugging
Face convention) and ``tool`` messages (``tool_call_id``) to it. For other templates the
gateway renders tools into plain messages with its generic format
(``node/openai_tools.py``).

Limits: at most :data:`MAX_MESSAGES` messages and :data:`MAX_PROMPT_CHARS` characters of
rendered prompt; violations raise :class:`ChatError` subclasses.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = [
    "ROLES",
    "MAX_MESSAGES",
    "MAX_PROMPT_CHARS",
    "ChatError",
    "UnknownRoleError",
    "EmptyPromptError",
    "MalformedMessagesError",
    "TemplateError",
    "RenderedChat",
    "ChatRenderer",
]

ROLES = frozenset({"system", "user", "assistant"})
TOOL_ROLES = ROLES | {"tool"}
MAX_MESSAGES = 1024
MAX_PROMPT_CHARS = 4 * 2**20
# Verifying a boundary re-renders and re-tokenizes the prefix; long conversations verify the
# first two and the last MAX_VERIFIED_BOUNDARIES - 2 message boundaries only.
MAX_VERIFIED_BOUNDARIES = 16

# SmolLM2-style ChatML, used when a GGUF carries no template at all.
_FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatError(ValueError):
    """A chat request cannot be rendered."""


class UnknownRoleError(ChatError):
    """A message has a role other than system, user or assistant."""


class EmptyPromptError(ChatError):
    """There are no messages, or the rendered prompt has no tokens."""


class MalformedMessagesError(ChatError):
    """Messages are not a list of {role, content: str} mappings, or exceed the limits."""


class TemplateError(ChatError):
    """The chat template failed to render (or raised through ``raise_exception``)."""


@dataclass(frozen=True)
class RenderedChat:
    text: str
    tokens: tuple[int, ...]
    # token counts at verified message boundaries (strictly increasing, each < len(tokens));
    # the prompt end (len(tokens)) is always a cache point and is not repeated here.
    boundaries: tuple[int, ...]


class _IgnoreGenerationTags(jinja2.ext.Extension):
    """Pass-through for HuggingFace's ``{% generation %}`` tag (as llama-cpp-python does)."""

    tags = {"generation"}

    def parse(self, parser):
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str):
    raise TemplateError(f"chat template refused the messages: {message}")


def normalize_messages(messages: object) -> list[dict[str, str]]:
    """Validate OpenAI-style messages into plain ``{"role", "content"}`` dicts."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise MalformedMessagesError("messages must be a list of {role, content} objects")
    if not messages:
        raise EmptyPromptError("a chat request needs at least one message")
    if len(messages) > MAX_MESSAGES:
        raise MalformedMessagesError(f"{len(messages)} messages exceed the limit of {MAX_MESSAGES}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise MalformedMessagesError(f"message {i} is not an object")
        role = m.get("role")
        if role not in ROLES:
            raise UnknownRoleError(
                f"message {i} has role {role!r}; expected one of {sorted(ROLES)}"
            )
        content = m.get("content")
        if not isinstance(content, str):
            raise MalformedMessagesError(f"message {i} content must be a string")
        out.append({"role": role, "content": content})
    return out


def normalize_tool_messages(messages: object) -> list[dict]:
    """Validate OpenAI-style messages of a tool conversation (roles incl. ``tool``; content a
    string or None; ``tool_calls`` a list of objects) into plain dicts."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes) or not messages:
        raise MalformedMessagesError("messages must be a non-empty list of objects")
    if len(messages) > MAX_MESSAGES:
        raise MalformedMessagesError(f"{len(messages)} messages exceed the limit of {MAX_MESSAGES}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in TOOL_ROLES:
            raise UnknownRoleError(f"message {i} is not an object with a role in "
                                   f"{sorted(TOOL_ROLES)}")
        content = m.get("content")
        calls = m.get("tool_calls")
        if content is not None and not isinstance(content, str):
            raise MalformedMessagesError(f"message {i} content must be a string or null")
        if calls is not None and not (isinstance(calls, list)
                                      and all(isinstance(c, Mapping) for c in calls)):
            raise MalformedMessagesError(f"message {i} tool_calls must be a list of objects")
        out.append(dict(m))
    return out


class ChatRenderer:
    """Renders chats for one model.

    ``tokenize(text) -> list[int]`` must tokenize with special tokens parsed and without
    adding a BOS (the engine passes ``lambda t: llama.tokenize(t.encode(), False, True)``).
    """

    def __init__(
        self,
        template: str | None,
        tokenize: Callable[[str], list[int]],
        *,
        bos_token: str = "",
        eos_token: str = "",
        bos_token_id: int | None = None,
        add_bos: bool = False,
    ) -> None:
        env = ImmutableSandboxedEnvironment(
            loader=jinja2.BaseLoader(),
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_IgnoreGenerationTags, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        self.template_source = template or _FALLBACK_TEMPLATE
        try:
            self._template = env.from_string(self.template_source)
            names = jinja2.meta.find_undeclared_variables(env.parse(self.template_source))
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the model's chat template does not compile: {exc}") from exc
        #: the template renders tool definitions (it refers to a ``tools`` variable)
        self.supports_tools = "tools" in names
        self._tokenize = tokenize
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._bos_id = bos_token_id
        self._add_bos = add_bos and bos_token_id is not None

    def render_text(self, messages: list[dict], add_generation_prompt: bool,
                    tools: list | None = None) -> str:
        extra = {} if tools is None else {"tools": tools}
        try:
            text = self._template.render(
                **extra,
                messages=messages,
                bos_token=self._bos_token,
                eos_token=self._eos_token,
                add_generation_prompt=add_generation_prompt,
                raise_exception=_raise_exception,
                strftime_now=lambda f: datetime.now().strftime(f),
            )
        except ChatError:
            raise
        except Exception as exc:  # jinja2 raises many types from inside templates
            raise TemplateError(f"chat template failed to render: {exc}") from exc
        if len(text) > MAX_PROMPT_CHARS:
            raise MalformedMessagesError(
                f"rendered prompt of {len(text)} characters exceeds {MAX_PROMPT_CHARS}"
            )
        return text

    def tokenize_text(self, text: str) -> list[int]:
        ids = list(self._tokenize(text))
        if self._add_bos and (not ids or ids[0] != self._bos_id):
            ids.insert(0, self._bos_id)
        return ids

    def render_tools(self, messages: object, tools: Sequence[Mapping]) -> RenderedChat:
        """Render a tool conversation with the model's own template (which must
        :attr:`supports_tools`); message boundaries are verified as in :meth:`render`."""
        if not self.supports_tools:
            raise TemplateError("the model's chat template does not render tools")
        return self.render(normalize_tool_messages(messages), tools=[dict(t) for t in tools],
                           _normalized=True)

    def render(self, messages: object, *, verify_boundaries: bool = True,
               tools: list | None = None, _normalized: bool = False) -> RenderedChat:
        msgs = messages if _normalized else normalize_messages(messages)
        text = self.render_text(msgs, add_generation_prompt=True, tools=tools)
        tokens = self.tokenize_text(text)
        if not tokens:
            raise EmptyPromptError("the rendered prompt has no tokens")
        boundaries: list[int] = []
        if verify_boundaries:
            n_msgs = len(msgs)
            candidates = range(1, n_msgs + 1)
            if n_msgs > MAX_VERIFIED_BOUNDARIES:
                tail = n_msgs + 1 - (MAX_VERIFIED_BOUNDARIES - 2)
                candidates = [1, 2, *range(tail, n_msgs + 1)]
            for i in candidates:
                prefix = self.render_text(msgs[:i], add_generation_prompt=False, tools=tools)
                if not prefix or not text.startswith(prefix):
                    continue  # the template renders history differently: no cache point
                head = self.tokenize_text(prefix)
                n = len(head)
                if 0 < n < len(tokens) and tokens[:n] == head and (
                    not boundaries or n > boundaries[-1]
                ):
                    boundaries.append(n)
        return RenderedChat(text=text, tokens=tuple(tokens), boundaries=tuple(boundaries))
