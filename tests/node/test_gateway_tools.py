"""Tool calling through the HTTP gateway of a real node (the default model), driven by the
official ``openai`` client: a forced tool call (named or ``required``) is a valid call of
the tool's schema, streamed and not; a ``tool`` message continues the conversation; the
tool definitions are a cached prefix for the next request with the same tools; what is
not supported is a 400 naming the parameter."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from _gateway import HttpNode
from _swarm import Swarm

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a time zone.",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string",
                                                                 "maxLength": 32}},
                       "required": ["zone"], "additionalProperties": False},
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with Swarm(tmp_path_factory.mktemp("tools")) as s:
        yield HttpNode(s, "A")


def _check_calls(calls, names=None) -> list[dict]:
    """Every call names a declared tool and its arguments validate against its schema."""
    assert calls, "no tool call"
    out = []
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        assert c.function.name in SCHEMAS and (names is None or c.function.name in names)
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[c.function.name])
        out.append(args)
    return out


def test_named_tool_choice_gives_a_valid_call_and_the_conversation_continues(node):
    client = node.client()
    first = client.chat.completions.create(
        model="prefixmesh", messages=ASK, tools=TOOLS, max_tokens=64, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (args,) = _check_calls(choice.message.tool_calls, {"get_weather"})
    assert args["unit"] in ("celsius", "fahrenheit")

    # the tool's answer goes back as a tool message; the model answers in text
    call = choice.message.tool_calls[0]
    follow = client.chat.completions.create(
        model="prefixmesh", tools=TOOLS, max_tokens=12, temperature=0, messages=[
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id,
             "content": json.dumps({"city": args["city"], "temperature": 18, "sky": "sunny"})},
        ])
    msg = follow.choices[0].message
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert msg.content or msg.tool_calls
    # the conversation so far (tools, question, call) is a prefix of this prompt: cached
    assert follow.usage.prompt_tokens > first.usage.prompt_tokens
    assert follow.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 2


def _definition_tokens() -> int:
    """Tokens of the system message holding the tool definitions (rendered as the gateway
    does, tokenized with the model's vocabulary)."""
    import llama_cpp
    from _model_fixture import default_model_path

    from prefixmesh.node import openai_schema

    req = openai_schema.parse_chat_request({"model": "m", "messages": ASK, "tools": TOOLS},
                                           default_max_tokens=8)
    role, content = req.messages[0]
    assert role == "system" and '"name": "get_time"' in content
    vocab = llama_cpp.Llama(model_path=str(default_model_path()), vocab_only=True,
                            verbose=False)
    text = f"<|im_start|>system\n{content}<|im_end|>\n"
    try:
        return len(vocab.tokenize(text.encode(), add_bos=False, special=True))
    finally:
        vocab.close()


def test_required_tool_choice_streams_a_valid_call_and_reuses_the_cached_definitions(node):
    client = node.client()
    before = client.chat.completions.create(
        model="prefixmesh", tools=TOOLS, tool_choice="required", max_tokens=64,
        temperature=0, parallel_tool_calls=False,
        messages=[{"role": "user", "content": "What time is it in Tokyo?"}])
    _check_calls(before.choices[0].message.tool_calls)

    stream = client.chat.completions.create(
        model="prefixmesh", messages=ASK, tools=TOOLS, tool_choice="required",
        max_tokens=64, temperature=0, parallel_tool_calls=False, stream=True,
        stream_options={"include_usage": True})
    calls: dict[int, dict] = {}
    finish = None
    chunks = list(stream)
    for ch in chunks:
        if not ch.choices:
            continue
        finish = ch.choices[0].finish_reason or finish
        for d in ch.choices[0].delta.tool_calls or ():
            c = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            c["id"] += d.id or ""
            c["name"] += (d.function.name or "") if d.function else ""
            c["arguments"] += (d.function.arguments or "") if d.function else ""
    assert finish == "tool_calls"
    assert len(calls) == 1
    (c,) = calls.values()
    assert c["id"].startswith("call_") and c["name"] in SCHEMAS
    jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])
    # the same tools, another question: the definitions come from the cache
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens >= _definition_tokens()


def test_tool_choice_none_and_auto_answer_without_errors(node):
    client = node.client()
    none = client.chat.completions.create(
        model="prefixmesh", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8,
        temperature=0)
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].finish_reason in ("stop", "length")
    auto = client.chat.completions.create(
        model="prefixmesh", messages=ASK, tools=TOOLS, max_tokens=24, temperature=0)
    msg = auto.choices[0].message
    if msg.tool_calls:  # the small model may or may not call a tool by itself
        _check_calls(msg.tool_calls)
        assert auto.choices[0].finish_reason in ("tool_calls", "length")
    else:
        assert msg.content is not None


@pytest.mark.parametrize(("extra", "param"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"n": 2}, "n"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {
            "x": {"type": "integer", "minimum": 0}}}}}], "tool_choice": "required"},
     "tools[0].function.parameters.properties.x"),
])
def test_refusals_name_the_parameter(node, extra, param):
    body = {"model": "prefixmesh", "messages": ASK, "tools": TOOLS, "max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as ei:
        node.client().chat.completions.create(**body)
    assert ei.value.status_code == 400
    assert ei.value.body["param"] == param, ei.value.body
