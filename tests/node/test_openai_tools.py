"""The pure parts of tool calling and structured output (node/openai_tools.py, the
request/response shapes in node/openai_schema.py): parsing, rendering, schema checks,
grammar generation, output parsing (whole and streamed, any chunking)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.node import openai_schema as s
from prefixmesh.node import openai_tools as t
from prefixmesh.node.http_gateway import _LogprobGate

FN = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
NAMES = ("get_weather", "get_time")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _chat(**body):
    return s.parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "q"}],
                                 **body}, default_max_tokens=8)


def test_tool_specs_and_choices_parse():
    assert _chat().tools is None
    spec = _chat(tools=[FN]).tools
    assert spec.names == ("get_weather",) and spec.choice == "auto" and spec.parallel
    assert not spec.constrained
    named = _chat(tools=[FN], tool_choice={"type": "function",
                                           "function": {"name": "get_weather"}}).tools
    assert (named.choice, named.function, named.constrained) == ("function", "get_weather",
                                                                 True)
    req = _chat(tools=[FN], tool_choice="required", parallel_tool_calls=False)
    assert req.tools.constrained and not req.tools.parallel
    assert _chat(tools=[{"type": "function", "function": {"name": "f"}}]).tools.tools[0] \
        .parameters == {"type": "object", "properties": {}}


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": [FN], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [FN], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ({"tools": [FN, FN]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [FN], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"function_call": "auto"}, "function_call"),
    ({"tools": [FN], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}},
     "response_format.json_schema.schema.properties.a"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "string", "format": "email"}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "$ref": "https://example.com/s.json"}}}}, "response_format.json_schema.schema"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_refusals_name_the_parameter(body, param):
    with pytest.raises(s.BadRequest) as ei:
        _chat(**body)
    assert ei.value.param == param, ei.value.message


def test_messages_with_tool_calls_and_tool_results_render_generically():
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "21 C"}]},
    ]
    req = s.parse_chat_request({"model": "m", "messages": msgs, "tools": [FN]},
                               default_max_tokens=8)
    roles = [r for r, _ in req.messages]
    assert roles == ["system", "user", "assistant", "user"]
    system = req.messages[0][1]
    assert system.startswith("Be brief.\n\n" + t.TOOLS_HEADER)
    assert json.dumps(FN) in system and system.endswith(t.TOOLS_FOOTER)
    assert req.messages[2][1] == CALL + "\n" + CALL.replace("Paris", "Rome")
    assert req.messages[3][1] == ("<tool_response>\n18 C\n</tool_response>\n"
                                  "<tool_response>\n21 C\n</tool_response>")
    # no system message: one is added; the definitions do not depend on tool_choice
    a = _chat(tools=[FN]).messages
    b = _chat(tools=[FN], tool_choice="required").messages
    assert a == b and a[0] == ("system", "\n".join([t.TOOLS_HEADER, json.dumps(FN),
                                                    t.TOOLS_FOOTER]))
    # without tools, plain messages are unchanged
    assert _chat().messages == (("user", "q"),)


def test_whole_answers_parse_into_calls_and_content():
    assert t.parse_tool_calls(CALL, NAMES) == (None, [("get_weather", '{"city": "Paris"}')])
    assert t.parse_tool_calls("Let me check. " + CALL, NAMES) == (
        "Let me check.", [("get_weather", '{"city": "Paris"}')])
    two = CALL + "\n" + CALL.replace("get_weather", "get_time")
    assert [n for n, _ in t.parse_tool_calls(two, NAMES)[1]] == ["get_weather", "get_time"]
    # an unknown tool, broken JSON, or arguments that are not an object stay content
    for text in (CALL.replace("get_weather", "launch"), CALL.replace("}}", "}"),
                 '<tool_call>{"name": "get_time", "arguments": 3}</tool_call>'):
        assert t.parse_tool_calls(text, NAMES) == (text, [])
    # an unterminated block at the end (max_tokens) still parses if its JSON is whole
    assert t.parse_tool_calls(CALL[: -len("</tool_call>")], NAMES)[1]
    # a bare JSON call, and arguments sent as a JSON string
    assert t.parse_tool_calls('{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}',
                              NAMES) == (None, [("get_time", '{"zone": "UTC"}')])
    assert t.parse_tool_calls("Just text.", NAMES) == ("Just text.", [])


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["", "Sure. ", "a < b <tool", "<tool_call>oops</tool_call> "]),
       st.sampled_from(["", " done", "<tool_c"]), st.data())
def test_streamed_parsing_is_independent_of_chunking(prefix, suffix, data):
    text = prefix + CALL + "\n" + CALL.replace("Paris", "Oslo") + suffix
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    p = t.ToolStreamParser(NAMES)
    events = []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        events += p.feed(text[a:b])
    events += p.finish()
    content = "".join(e[1] for e in events if e[0] == "content")
    calls = [e[1:] for e in events if e[0] == "call"]
    assert calls == [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Oslo"}')]
    assert content == prefix + suffix
    whole = t.parse_tool_calls(text, NAMES)
    assert whole == ((prefix + suffix).strip() or None, calls)


@pytest.fixture(scope="module")
def compiles():
    """Whether llama.cpp's grammar parser accepts a grammar (the model's vocabulary)."""
    import llama_cpp
    from _model_fixture import default_model_path
    from llama_cpp import llama_cpp as lib

    llm = llama_cpp.Llama(model_path=str(default_model_path()), vocab_only=True, verbose=False)

    def check(grammar: str) -> bool:
        ptr = lib.llama_sampler_init_grammar(llm._model.vocab, grammar.encode(), b"root")
        if ptr:
            lib.llama_sampler_free(ptr)
        return bool(ptr)

    yield check
    llm.close()


def test_grammars_are_generated_for_tool_choices_and_response_formats(compiles):
    time_fn = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
    required = _chat(tools=[FN, time_fn], tool_choice="required").tools
    g = t.tool_grammar(required)
    assert '"\\"get_weather\\""' in g and '"\\"get_time\\""' in g
    assert "{0,3}" in g and compiles(g)
    single = t.tool_grammar(_chat(tools=[FN, time_fn], tool_choice="required",
                                  parallel_tool_calls=False).tools)
    assert "{0," not in single and compiles(single)
    named = t.tool_grammar(_chat(tools=[FN, time_fn], tool_choice={
        "type": "function", "function": {"name": "get_time"}}).tools)
    assert "get_weather" not in named and "{0," not in named and compiles(named)
    obj = t.format_grammar(_chat(response_format={"type": "json_object"}).response_format)
    assert compiles(obj)
    schema = {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                 "maxItems": 3},
        "when": {"type": "string", "format": "date"},
        "kind": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "ref": {"$ref": "#/$defs/point"}},
        "required": ["tags"], "$defs": {"point": {"type": "object", "properties": {
            "x": {"type": "number"}}, "required": ["x"]}}}
    rf = _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "s", "strict": True, "schema": schema}}).response_format
    assert (rf.kind, rf.name, rf.strict) == ("json_schema", "s", True)
    assert compiles(t.format_grammar(rf))
    # a schema the converter refuses is a 400 naming the parameter
    bad = t.ResponseFormat("json_schema", {"type": "string", "pattern": "abc"})
    with pytest.raises(t.ToolsError) as ei:
        t.format_grammar(bad)
    assert ei.value.param == "response_format" and "grammar" in ei.value.message


def test_logprobs_shapes_and_the_stop_sequence_gate():
    e = SimpleNamespace(piece=b"Hi", logprob=-0.25, top=((b"Hi", -0.25), (b"\xc3", -3.0)))
    chat = s.chat_logprobs([e])
    assert chat["content"][0] == {
        "token": "Hi", "logprob": -0.25, "bytes": [72, 105],
        "top_logprobs": [{"token": "Hi", "logprob": -0.25, "bytes": [72, 105]},
                         {"token": "\ufffd", "logprob": -3.0, "bytes": [195]}]}
    legacy = s.completion_logprobs([e, e], offset=3)
    assert legacy["tokens"] == ["Hi", "Hi"] and legacy["text_offset"] == [3, 5]
    assert legacy["top_logprobs"][0] == {"Hi": -0.25, "\ufffd": -3.0}
    assert _chat(logprobs=True).logprobs == 0 and _chat(logprobs=True, top_logprobs=4) \
        .logprobs == 4 and _chat().logprobs == -1
    assert s.parse_completion_request({"model": "m", "prompt": "p", "logprobs": 3},
                                      default_max_tokens=8).logprobs == 3
    out: list = []
    gate = _LogprobGate(out)
    entries = [SimpleNamespace(piece=p) for p in (b"He", b"llo", b" ST", b"OP")]
    gate.add(entries[:2])
    gate.release("H")
    assert out == []  # "He" not released yet
    gate.release("ello")
    assert out == entries[:2]
    gate.add(entries[2:])
    gate.release(" ")  # the stop sequence " STOP" was cut: its tokens never come out
    assert out == entries[:2]
    gate.release("", everything=True)
    assert out == entries
