"""Structured output and logprobs through the HTTP gateway of a real node (the default
model), driven by the official ``openai`` client: every ``json_schema`` answer validates
against its schema (20 requests, greedy and sampled, streamed and not), ``json_object``
answers are JSON objects, a schema a grammar cannot enforce is a 400, and logprobs
(chat and completions, streamed and not) are finite, sorted, and equal to an
independent llama.cpp computation of the same tokens."""

from __future__ import annotations

import json
import math

import jsonschema
import numpy as np
import openai
import pytest
from _gateway import HttpNode
from _model_fixture import TEST_THREADS, default_model_path
from _swarm import Swarm

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer"},
        "pet": {"enum": ["cat", "dog", "none"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
TOPICS = ["a sailor", "a baker", "a child", "a pilot", "a poet", "a doctor", "a farmer",
          "a student", "a painter", "a teacher"]


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with Swarm(tmp_path_factory.mktemp("structured")) as s:
        yield HttpNode(s, "A")


def _fmt(schema=PERSON):
    return {"type": "json_schema",
            "json_schema": {"name": "person", "strict": True, "schema": schema}}


def test_twenty_json_schema_answers_all_validate(node):
    client = node.client()
    answers = []
    for i in range(20):
        kw = dict(model="prefixmesh", max_tokens=40, response_format=_fmt(),
                  messages=[{"role": "user", "content": f"Describe {TOPICS[i % 10]} as JSON."}])
        if i >= 10:  # the second half sampled, with seeds
            kw.update(temperature=0.8, seed=i)
        else:
            kw.update(temperature=0)
        if i % 4 == 3:
            text = "".join(ch.choices[0].delta.content or ""
                           for ch in client.chat.completions.create(stream=True, **kw)
                           if ch.choices)
        else:
            resp = client.chat.completions.create(**kw)
            assert resp.choices[0].finish_reason == "stop"
            text = resp.choices[0].message.content
        obj = json.loads(text)
        jsonschema.validate(obj, PERSON)
        answers.append(obj)
    assert len({json.dumps(a, sort_keys=True) for a in answers}) > 1  # not one canned answer


def test_json_object_answers_are_objects_and_unenforceable_schemas_are_refused(node):
    client = node.client()
    resp = client.chat.completions.create(
        model="prefixmesh", max_tokens=48, temperature=0,
        response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give me a JSON object about the moon."}])
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(resp.choices[0].message.content), dict)
    else:  # max_tokens cut a valid prefix of an object
        assert resp.choices[0].message.content.startswith("{")
    for schema, param in [
        ({"type": "integer", "minimum": 3}, "response_format.json_schema.schema"),
        ({"type": "object", "properties": {"a": {"type": "string", "format": "email"}}},
         "response_format.json_schema.schema.properties.a"),
        ({"type": "string", "pattern": "no anchors"}, "response_format"),
    ]:
        with pytest.raises(openai.BadRequestError) as ei:
            client.chat.completions.create(
                model="prefixmesh", max_tokens=8, response_format=_fmt(schema),
                messages=[{"role": "user", "content": "x"}])
        assert ei.value.body["param"] == param, ei.value.body
        assert ei.value.body["code"] == "invalid_schema"


def test_ollama_format_is_enforced_the_same_way(node):
    import ollama

    c = ollama.Client(host=node.url, timeout=120)
    opts = {"temperature": 0, "num_predict": 40}
    r = c.chat(model="prefixmesh", format=PERSON, options=opts,
               messages=[{"role": "user", "content": "Describe a sailor as JSON."}])
    jsonschema.validate(json.loads(r.message.content), PERSON)
    g = c.generate(model="prefixmesh", prompt="A JSON object about the sea:", format="json",
                   options=opts)
    if g.done_reason == "stop":
        assert isinstance(json.loads(g.response), dict)
    else:
        assert g.response.startswith("{")
    with pytest.raises(ollama.ResponseError) as ei:
        c.chat(model="prefixmesh", format={"type": "integer", "minimum": 1},
               messages=[{"role": "user", "content": "x"}])
    assert ei.value.status_code == 400 and "minimum" in str(ei.value)


# --- logprobs -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference():
    """An independent llama.cpp context of the same model: the logits before each token
    (prompt body in one batch, last prompt token alone, then each token alone, as the
    engine evaluates them), and the prompt tokens of a chat (the model's template)."""
    import llama_cpp
    from llama_cpp import llama_cpp as lib

    from prefixmesh.inference.chat import ChatRenderer
    from prefixmesh.inference.model import read_gguf_info

    original = lib.llama_model_default_params

    def no_repack():
        p = original()
        p.use_extra_bufts = False  # as the engine loads the model
        return p

    lib.llama_model_default_params = no_repack
    try:
        llm = llama_cpp.Llama(model_path=str(default_model_path()), n_ctx=4096,
                              n_threads=TEST_THREADS, n_threads_batch=TEST_THREADS,
                              verbose=False)
    finally:
        lib.llama_model_default_params = original
    renderer = ChatRenderer(read_gguf_info(default_model_path()).chat_template,
                            lambda t: llm.tokenize(t.encode(), add_bos=False, special=True))
    n = llm.n_vocab()

    def logprobs(prompt: list[int], steps: int) -> list[np.ndarray]:
        """log-softmax before each of ``steps`` greedy tokens."""
        llm.reset()
        llm._ctx.kv_cache_clear()
        llm.eval(prompt[:-1])
        llm.eval(prompt[-1:])
        out = []
        for _ in range(steps):
            x = np.ctypeslib.as_array(lib.llama_get_logits_ith(llm._ctx.ctx, -1),
                                      shape=(n,)).astype(np.float64)
            lse = x.max() + np.log(np.exp(x - x.max()).sum())
            out.append(x - lse)
            llm.eval([int(np.argmax(x))])
        return out

    def chat_tokens(messages) -> list[int]:
        return list(renderer.render(messages, verify_boundaries=False).tokens)

    ref = type("Ref", (), {})()
    ref.logprobs, ref.chat_tokens = logprobs, chat_tokens
    ref.tokenize = lambda text: llm.tokenize(text.encode(), add_bos=False, special=True)
    ref.piece = lambda tok: llm.detokenize([tok])
    yield ref
    llm.close()


def _check_entries(entries, ref_lp, ref, top_n):
    """Finite, sorted, and the chosen token's logprob equals the reference's; returns the
    largest difference."""
    worst = 0.0
    for e, lp in zip(entries, ref_lp, strict=False):
        tok = int(np.argmax(lp))
        assert bytes(e.bytes) == ref.piece(tok), (e, tok)
        assert math.isfinite(e.logprob) and e.logprob <= 0.0
        worst = max(worst, abs(e.logprob - lp[tok]))
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == top_n and tops == sorted(tops, reverse=True)
        assert all(math.isfinite(x) for x in tops)
        if top_n:
            assert tops[0] == pytest.approx(e.logprob)
    return worst


def test_chat_logprobs_equal_the_engines_streamed_and_not(node, reference):
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    client = node.client()
    resp = client.chat.completions.create(model="prefixmesh", messages=messages, max_tokens=8,
                                          temperature=0, logprobs=True, top_logprobs=5)
    entries = resp.choices[0].logprobs.content
    assert len(entries) == resp.usage.completion_tokens
    assert "".join(e.token for e in entries) == resp.choices[0].message.content
    ref_lp = reference.logprobs(reference.chat_tokens(messages), len(entries))
    worst = _check_entries(entries, ref_lp, reference, 5)
    assert worst < 1e-3, worst

    streamed = [e for ch in client.chat.completions.create(
        model="prefixmesh", messages=messages, max_tokens=8, temperature=0, logprobs=True,
        top_logprobs=2, stream=True) if ch.choices and ch.choices[0].logprobs
        for e in ch.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert _check_entries(streamed, ref_lp, reference, 2) < 1e-3
    plain = client.chat.completions.create(model="prefixmesh", messages=messages, max_tokens=4,
                                           temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_equal_the_engines(node, reference):
    prompt = "The capital of France is"
    raw = node.client().completions.create(model="prefixmesh", prompt=prompt, max_tokens=6,
                                           temperature=0, logprobs=3)
    lp = raw.choices[0].logprobs
    assert len(lp.tokens) == raw.usage.completion_tokens
    assert "".join(lp.tokens) == raw.choices[0].text
    ref_lp = reference.logprobs(reference.tokenize(prompt), len(lp.tokens))
    for i, (token_lp, top) in enumerate(zip(lp.token_logprobs, lp.top_logprobs, strict=True)):
        want = float(ref_lp[i].max())
        assert abs(token_lp - want) < 1e-3
        assert len(top) == 3 and max(top.values()) == pytest.approx(token_lp)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
