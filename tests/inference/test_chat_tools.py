"""Chat templates that render tools (inference/chat.py ``supports_tools``/``render_tools``)
and the gateway's choice between the model's own template and the generic format."""

from __future__ import annotations

import json

import pytest
import trio
from _model_fixture import default_model_path

from prefixmesh.inference.chat import ChatRenderer, TemplateError, UnknownRoleError
from prefixmesh.inference.model import read_gguf_info
from prefixmesh.node import openai_schema
from prefixmesh.node.http_gateway import GenerationJob, NodeGatewayBackend

# a Qwen2.5-style template (abridged): tools in the system turn, calls as <tool_call>
# blocks, tool results as <tool_response> in a user turn
QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{%- endif %}"
    "\n# Tools\n<tools>{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>"
    "<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and tools %}"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- elif m.tool_calls %}<|im_start|>assistant\n{%- for c in m.tool_calls %}\n"
    "<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
BODY = {"model": "m", "tools": [TOOL], "messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]}


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_the_default_models_template_does_not_render_tools():
    tpl = read_gguf_info(default_model_path()).chat_template
    assert not ChatRenderer(tpl, chars).supports_tools
    assert not ChatRenderer(None, chars).supports_tools  # the fallback ChatML
    with pytest.raises(TemplateError, match="does not render tools"):
        ChatRenderer(tpl, chars).render_tools([{"role": "user", "content": "x"}], [TOOL])


def test_a_tool_template_renders_definitions_calls_and_results():
    r = ChatRenderer(QWEN_LIKE, chars)
    assert r.supports_tools
    req = openai_schema.parse_chat_request(BODY, default_max_tokens=8)
    messages, tools = req.tool_chat
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert messages[3] == {"role": "tool", "content": "-3 C", "tool_call_id": "call_1"}
    out = r.render_tools(list(messages), list(tools))
    # ({%- strips the newline before each tag)
    assert out.text.startswith("<|im_start|>systemBe brief.# Tools\n<tools>"
                               + json.dumps(TOOL, ensure_ascii=False))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' in out.text
    assert "<tool_response>\n-3 C\n</tool_response>" in out.text
    assert out.text.endswith("<|im_start|>assistant")
    assert tuple(chars(out.text)) == out.tokens
    assert out.boundaries  # message boundaries are verified as for plain chats
    with pytest.raises(UnknownRoleError):
        r.render_tools([{"role": "robot", "content": "x"}], [TOOL])
    plain = openai_schema.parse_chat_request(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, default_max_tokens=8)
    assert plain.tool_chat is None


class _Stub:
    """A backend stub: records which rendering the gateway asked for."""

    def __init__(self, supports_tools: bool):
        self.supports_tools = supports_tools
        self.calls: list[str] = []

    async def tokenize(self, messages):
        self.calls.append("generic")
        return (1, 2)

    async def tokenize_chat(self, messages, tools):
        self.calls.append("native")
        return (3, 4)


@pytest.mark.parametrize("native", [True, False])
def test_the_gateway_uses_the_models_template_only_when_it_renders_tools(native):
    req = openai_schema.parse_chat_request(BODY, default_max_tokens=8)
    job = GenerationJob(tenant="public", sampling=req.sampling, deadline_s=5,
                        messages=req.messages, tool_chat=req.tool_chat)
    stub = _Stub(native)
    gw = NodeGatewayBackend(infer=None, backend=stub, tenants=None, model_ids=["m"])
    tokens = trio.run(gw._prompt_tokens, job)
    assert stub.calls == (["native"] if native else ["generic"])
    assert tokens == ((3, 4) if native else (1, 2))
