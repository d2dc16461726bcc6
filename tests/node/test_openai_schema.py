"""node/openai_schema.py: request validation, response shapes and stop sequences (pure;
property-based)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.node import openai_schema as s

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)
KEYS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
        "top_p", "seed", "stop", "n", "stream", "stream_options", "logprobs", "tools", "echo",
        "response_format", "user", "suffix", "best_of"]
request_like = st.dictionaries(st.sampled_from(KEYS), json_values, max_size=8)


@settings(max_examples=200)
@given(st.binary(max_size=300))
def test_parse_json_body_only_raises_api_errors(raw):
    try:
        obj = s.parse_json_body(raw)
    except s.ApiError as exc:
        assert exc.status == 400
        assert set(exc.body()["error"]) == {"message", "type", "param", "code"}
    else:
        assert isinstance(obj, dict)


@settings(max_examples=200)
@given(request_like)
def test_parsers_accept_or_refuse_with_bad_request(obj):
    for parse in (s.parse_chat_request, s.parse_completion_request):
        try:
            req = parse(obj, default_max_tokens=16)
        except s.BadRequest as exc:
            body = exc.body()["error"]
            assert body["type"] == "invalid_request_error" and body["message"]
            assert exc.status == 400
        else:
            sp = req.sampling
            assert 1 <= sp.max_tokens <= s.MAX_MAX_TOKENS
            assert 0.0 <= sp.temperature <= 2.0 and 0.0 <= sp.top_p <= 1.0
            assert 0 <= sp.seed <= s.MAX_SEED
            assert all(isinstance(x, str) and x for x in sp.stop)
            assert isinstance(req.model, str)
            if parse is s.parse_completion_request:  # text, or token ids used as they are
                assert req.prompt and (isinstance(req.prompt, str) or all(
                    type(t) is int and t >= 0 for t in req.prompt))


def test_valid_chat_request_fields():
    req = s.parse_chat_request({
        "model": "m", "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "developer", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]},
                     {"role": "assistant", "content": "ok"}],
        "max_completion_tokens": 9, "max_tokens": 99, "temperature": 0, "top_p": 0.5,
        "seed": 3, "stop": "END", "n": 1, "user": "u1", "frequency_penalty": 0.2,
    }, default_max_tokens=16)
    assert req.messages == (("system", "be brief"), ("user", "ab"), ("assistant", "ok"))
    assert req.sampling == s.SamplingOptions(max_tokens=9, temperature=0.0, top_p=0.5, seed=3,
                                             stop=("END",))
    assert req.stream and req.include_usage
    default = s.parse_chat_request({"model": "m", "messages": [{"role": "user", "content": ""}]},
                                   default_max_tokens=16)
    assert default.sampling == s.SamplingOptions(max_tokens=16)
    assert not default.stream and not default.include_usage


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"model": "m", "messages": []}, "messages", "invalid_value"),
    ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content",
     "missing_required_parameter"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]", "unsupported_value"),
    ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role",
     "invalid_value"),
    ({"model": "m", "messages": [{"role": "tool", "content": "x"}]},
     "messages[0].tool_call_id", "invalid_type"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5},
     "stop", "invalid_value"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": [""]},
     "stop", "invalid_value"),
    # logprobs, tools and response_format are supported (tests/node/test_openai_tools.py);
    # what remains refused is named
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs", "invalid_value"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True,
      "top_logprobs": 21}, "top_logprobs", "invalid_value"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{}]},
     "tools[0].function", "invalid_type"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "functions": [{}]},
     "functions", "unsupported_parameter"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema", "json_schema": {
          "name": "n", "schema": {"type": "integer", "minimum": 3}}}},
     "response_format.json_schema.schema", "invalid_schema"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "xml"}}, "response_format", "unsupported_value"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}],
      "stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5},
     "max_tokens", "invalid_type"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9},
     "max_tokens", "invalid_value"),
])
def test_chat_request_refusals(body, param, code):
    with pytest.raises(s.BadRequest) as ei:
        s.parse_chat_request(body, default_max_tokens=16)
    assert (ei.value.param, ei.value.code) == (param, code)


def test_completion_request_prompt_forms():
    def parse(prompt):
        return s.parse_completion_request({"model": "m", "prompt": prompt},
                                          default_max_tokens=16).prompt

    assert parse(["one"]) == "one"
    # one prompt of token ids, bare or as a batch of one: used as they are
    assert parse([1, 2, 0]) == (1, 2, 0)
    assert parse([[7, 8]]) == (7, 8)
    assert parse([5]) == (5,)
    for prompt, code in ((["a", "b"], "unsupported_value"), ([[1], [2]], "unsupported_value"),
                         ([1, "a"], "unsupported_value"), ([True, 2], "unsupported_value"),
                         ([1.0, 2], "unsupported_value"), ([["a"]], "unsupported_value"),
                         ([1, -1], "invalid_value"), ([], "invalid_value"),
                         ([[]], "invalid_value"), ("", "invalid_value"),
                         (5, "invalid_type"), ({"t": 1}, "invalid_type")):
        with pytest.raises(s.BadRequest) as ei:
            parse(prompt)
        assert (ei.value.param, ei.value.code) == ("prompt", code), prompt
    for extra in ({"echo": True}, {"suffix": "x"}, {"best_of": 2}):
        with pytest.raises(s.BadRequest):
            s.parse_completion_request({"model": "m", "prompt": "p", **extra},
                                       default_max_tokens=16)


def test_json_limits():
    with pytest.raises(s.BadRequest):
        s.parse_json_body(b"[" * (s.MAX_JSON_DEPTH + 1) + b"]" * (s.MAX_JSON_DEPTH + 1))
    nested = b'{"a":' * (s.MAX_JSON_DEPTH - 1) + b"1" + b"}" * (s.MAX_JSON_DEPTH - 1)
    assert s.parse_json_body(nested)
    # brackets inside strings do not count as nesting
    assert s.parse_json_body(json.dumps({"x": "[[[[" * 100}).encode())
    with pytest.raises(s.BadRequest):
        s.parse_json_body(b'{"temperature": NaN}')
    with pytest.raises(s.PayloadTooLarge):
        s.parse_json_body(b" " * (s.MAX_BODY_BYTES + 1))


def test_response_shapes():
    u = s.Usage(prompt_tokens=10, completion_tokens=3, cached_tokens=8)
    assert s.usage_object(u) == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                                 "prompt_tokens_details": {"cached_tokens": 8}}
    chunk = s.chat_chunk_object(id="c", created=1, model="m", delta=None, usage=u,
                                ext={"route": None})
    assert chunk["choices"] == [] and chunk["usage"]["total_tokens"] == 13
    assert chunk["prefixmesh"] == {"route": None}
    ev = s.sse_event({"a": "é"})
    assert ev.startswith(b"data: ") and ev.endswith(b"\n\n") and b"\n" not in ev[:-2]
    assert json.loads(ev[6:]) == {"a": "é"}
    assert s.models_object(["x"])["data"][0]["id"] == "x"


# --- stop sequences ----------------------------------------------------------------------

alphabet = st.sampled_from("ab\n.")


def _expected(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """Cut where a generator checking after every character would: at the start of the
    first stop sequence to be completed (ties: the one starting first)."""
    for end in range(1, len(text) + 1):
        starts = [end - len(x) for x in stops if end >= len(x) and text[end - len(x):end] == x]
        if starts:
            return text[: min(starts)], True
    return text, False


@settings(max_examples=300)
@given(st.text(alphabet, max_size=40),
       st.lists(st.text(alphabet, min_size=1, max_size=4), max_size=3, unique=True),
       st.lists(st.integers(0, 40), max_size=10))
def test_stop_scanner_matches_find_whatever_the_chunking(text, stops, cuts):
    stops = tuple(stops)
    points = sorted({c for c in cuts if c <= len(text)} | {0, len(text)})
    chunks = [text[i:j] for i, j in zip(points, points[1:], strict=False)]
    scanner = s.StopScanner(stops)
    out = "".join(scanner.feed(c) for c in chunks)
    out += scanner.flush()
    want, stopped = _expected(text, stops)
    assert out == want
    assert scanner.stopped == stopped


@settings(max_examples=200)
@given(st.text(alphabet, max_size=30),
       st.lists(st.text(alphabet, min_size=1, max_size=4), min_size=1, max_size=3))
def test_stop_scanner_never_emits_part_of_a_stop_early(text, stops):
    """Whatever was emitted so far is a prefix of the final answer (nothing retracted)."""
    scanner = s.StopScanner(tuple(stops))
    emitted = ""
    for ch in text:
        emitted += scanner.feed(ch)
        want, _ = _expected(text, tuple(stops))
        assert want.startswith(emitted)
