"""The Ollama API (node/ollama_api.py): the translation as pure functions, then over real
HTTP with the official ``ollama`` client, against the gateway's fake backend and against
a real node with the real model."""

from __future__ import annotations

import json

import httpx
import ollama
import pytest
from _gateway import MODEL, HttpNode, running
from _swarm import Swarm

from prefixmesh.node.ollama_api import (
    DEFAULT_TEMPERATURE,
    parse_ollama_chat,
    parse_ollama_generate,
)
from prefixmesh.node.openai_schema import BadRequest, ChatRequest, CompletionRequest

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def chat(**kw):
    return parse_ollama_chat({"model": "m", "messages": MSGS, **kw}, default_max_tokens=64)


# --- translation ---------------------------------------------------------------------------


def test_chat_defaults_follow_ollama_streaming_and_sampling():
    r = chat()
    assert r.stream is True and isinstance(r.openai, ChatRequest)
    assert r.openai.messages == (("system", "Be brief."), ("user", "Hi"))
    assert r.openai.sampling.temperature == DEFAULT_TEMPERATURE
    assert r.openai.sampling.max_tokens == 64


def test_options_map_to_sampling_and_unbounded_num_predict_is_the_default():
    r = chat(stream=False, options={"temperature": 0, "top_p": 0.5, "seed": 7,
                                    "num_predict": 5, "stop": ["\n"], "num_ctx": 4096})
    s = r.openai.sampling
    assert (s.temperature, s.top_p, s.seed, s.max_tokens, s.stop) == (0, 0.5, 7, 5, ("\n",))
    assert chat(options={"num_predict": -1}).openai.sampling.max_tokens == 64


@pytest.mark.parametrize("kw, param", [
    ({"format": 5}, "format"),
    ({"format": {"type": "integer", "minimum": 1}}, "format"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"think": True}, "think"),
    ({"options": {"top_k": 40}}, "options.top_k"),
    ({"options": {"nonsense": 1}}, "options.nonsense"),
    ({"options": {"temperature": "hot"}}, "options.temperature"),
    ({"options": {"num_predict": 10**9}}, "options.num_predict"),
    ({"stream": "yes"}, "stream"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(kw, param):
    with pytest.raises(BadRequest) as exc:
        chat(**kw)
    assert exc.value.param == param, exc.value.message


def test_neutral_values_of_unsupported_options_are_accepted():
    assert chat(options={"top_k": 0, "repeat_penalty": 1.0, "min_p": 0.0}).openai


def test_images_in_a_message_are_refused_by_name():
    msgs = [{"role": "user", "content": "what is this", "images": ["aGk="]}]
    with pytest.raises(BadRequest) as exc:
        parse_ollama_chat({"model": "m", "messages": msgs}, default_max_tokens=8)
    assert exc.value.param == "messages[0].images"


def test_generate_uses_the_chat_template_unless_raw():
    g = parse_ollama_generate({"model": "m", "prompt": "Hi", "system": "S"},
                              default_max_tokens=8)
    assert g.openai.messages == (("system", "S"), ("user", "Hi"))
    raw = parse_ollama_generate({"model": "m", "prompt": "Hi", "raw": True},
                                default_max_tokens=8)
    assert isinstance(raw.openai, CompletionRequest) and raw.openai.prompt == "Hi"
    assert parse_ollama_generate({"model": "m"}, default_max_tokens=8).openai is None
    with pytest.raises(BadRequest) as exc:
        parse_ollama_generate({"model": "m", "prompt": "x", "context": [1, 2]},
                              default_max_tokens=8)
    assert exc.value.param == "context"


# --- over HTTP, fake backend ----------------------------------------------------------------


def test_the_ollama_client_chats_streams_generates_and_lists():
    with running() as (gw, backend):
        c = ollama.Client(host=gw.url, timeout=20)
        r = c.chat(model=MODEL, messages=MSGS, options={"num_predict": 3})
        assert r.message.role == "assistant" and r.message.content == "Hello world."
        assert r.done and r.done_reason == "length" and r.eval_count == 3
        assert r.prompt_eval_count > 0
        parts = list(c.chat(model=MODEL, messages=MSGS, stream=True))
        assert "".join(p.message.content for p in parts) == "Hello world. Bye now"
        assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
        g = c.generate(model=MODEL + ":latest", prompt="Hi", options={"num_predict": 2})
        assert g.response == "Hello world"
        names = [m.model for m in c.list().models]
        assert MODEL in names
        assert c.show(MODEL).details.format == "gguf"
        assert backend.jobs[-1].messages == (("user", "Hi"),)


def test_errors_have_ollamas_shape_and_the_openai_status():
    with running() as (gw, _):
        r = httpx.post(gw.url + "/api/chat", json={"model": "nope", "messages": MSGS})
        assert r.status_code == 404 and "nope" in r.json()["error"]
        r = httpx.post(gw.url + "/api/chat", json={"model": MODEL, "messages": MSGS,
                                                    "format": {"not": {}}})
        assert r.status_code == 400 and "format" in r.json()["error"]
        r = httpx.get(gw.url + "/api/chat")
        assert r.status_code == 405 and "POST" in r.json()["error"]
        r = httpx.post(gw.url + "/api/chat", content=b"{not json")
        assert r.status_code == 400 and set(r.json()) == {"error"}
        assert httpx.get(gw.url + "/api/nothing").status_code == 404
        assert "version" in httpx.get(gw.url + "/api/version").json()
        with pytest.raises(ollama.ResponseError) as exc:
            ollama.Client(host=gw.url).chat(model="nope", messages=MSGS)
        assert exc.value.status_code == 404


def test_streamed_lines_are_ndjson_ending_with_the_counts():
    with running() as (gw, _):
        with httpx.stream("POST", gw.url + "/api/generate",
                          json={"model": MODEL, "prompt": "Hi"}) as r:
            assert r.headers["content-type"].startswith("application/x-ndjson")
            lines = [json.loads(x) for x in r.iter_lines() if x]
        assert all(not x["done"] for x in lines[:-1]) and lines[-1]["done"]
        assert lines[-1]["eval_count"] == 5 and lines[-1]["total_duration"] > 0


def test_tenant_and_key_rules_are_those_of_the_openai_endpoints():
    with running(api_keys={"k-team": "team"}) as (gw, backend):
        r = httpx.post(gw.url + "/api/chat", json={"model": MODEL, "messages": MSGS,
                                                    "stream": False})
        assert r.status_code == 401 and "error" in r.json()
        ok = ollama.Client(host=gw.url, headers={"Authorization": "Bearer k-team"})
        assert ok.chat(model=MODEL, messages=MSGS, options={"num_predict": 1}).done
        assert backend.jobs[-1].tenant == "team"


# --- a real node ------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_ollama_client_through_a_real_node(tmp_path):
    with Swarm(tmp_path) as s:
        node = HttpNode(s, "A")
        c = ollama.Client(host=node.url, timeout=120)
        [model] = [m.model for m in c.list().models if m.model != "prefixmesh"][:1] or \
            [c.list().models[0].model]
        opts = {"temperature": 0, "num_predict": 8}
        first = c.chat(model=model, messages=MSGS, options=opts)
        assert first.done and first.eval_count >= 1 and first.message.content
        streamed = "".join(p.message.content for p in
                           c.chat(model=model, messages=MSGS, options=opts, stream=True))
        assert streamed == first.message.content  # greedy: the same answer both ways
