"""Constrained output across the mesh (two real node processes, the default model, the
official ``openai`` client): a tool call and a ``json_schema`` answer entering at a node
without the prompt's prefix are forwarded to the node that holds it, which compiles the
grammar carried in the REQUEST frame and serves them; the relayed answers are the same
as the ones that node gave when it was itself the entry node (greedy decoding), and
logprobs come back through the relay."""

from __future__ import annotations

import json

import jsonschema
import pytest
from _gateway import HttpNode
from _swarm import Swarm, peers, wait_until

pytestmark = pytest.mark.slow

SYSTEM = (
    "You are the booking assistant of a small travel agency. Answer briefly and use the "
    "tools when the customer asks about weather or prices. The agency sells trips to "
    "Paris, Rome, Oslo, Lisbon, Vienna, Prague, Dublin, Madrid and Athens. "
) * 5
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TRIP = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "nights": {"type": "integer"},
    "hotel": {"type": "boolean"}}, "required": ["city", "nights", "hotel"],
    "additionalProperties": False}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with Swarm(tmp_path_factory.mktemp("relayed")) as s:
        b = HttpNode(s, "B")
        a = HttpNode(s, "A", bootstrap=[b.proc.addr])
        wait_until(lambda: all(sum(p.up for p in peers(n.proc.addr).peers) == 1
                               for n in (a, b)), timeout_s=30, what="the two nodes up")
        yield a, b


def _tool_request(client, **kw):
    return client.chat.completions.create(
        model="prefixmesh", tools=[WEATHER], max_tokens=48, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        messages=[{"role": "system", "content": SYSTEM},
                  {"role": "user", "content": "Is it warm in Lisbon now?"}], **kw)


def _json_request(client):
    stream = client.chat.completions.create(
        model="prefixmesh", tools=[WEATHER], tool_choice="none", max_tokens=40,
        temperature=0, stream=True, logprobs=True, top_logprobs=2,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "trip", "strict": True, "schema": TRIP}},
        messages=[{"role": "system", "content": SYSTEM},
                  {"role": "user", "content": "Book me a trip to Rome as JSON."}])
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    lps = [e for ch in chunks if ch.choices and ch.choices[0].logprobs
           for e in ch.choices[0].logprobs.content]
    return text, lps, chunks[-1].model_extra["prefixmesh"]["route"]


def _known(entry: HttpNode, holder: HttpNode, blocks: int) -> bool:
    info = {p.peer: p for p in peers(entry.proc.addr).peers}.get(holder.proc.peer_id)
    return (info is not None and info.n_hashes >= blocks and info.up and info.active == 0
            and info.queue_depth == 0)


def test_relayed_tool_call_and_json_equal_the_holders_own(pair):
    a, b = pair
    # served by B as the entry node: B caches the long prefix (system prompt + tools)
    own_call = _tool_request(b.client())
    own_text, own_lps, own_route = _json_request(b.client())
    assert own_route["serving"] == b.proc.peer_b58
    jsonschema.validate(json.loads(own_text), TRIP)
    blocks = own_call.usage.prompt_tokens // 16 - 2
    wait_until(lambda: b.status()["engine"]["active"] == 0, timeout_s=10, what="B idle")
    wait_until(lambda: _known(a, b, blocks), timeout_s=30, interval_s=0.2,
               what="A to learn B's prefix and see B idle")

    # the same requests entering at A (no cache): forwarded to B, grammar carried along
    relayed = _tool_request(a.client())
    route = relayed.model_extra["prefixmesh"]["route"]
    assert route["entry"] == a.proc.peer_b58 and route["serving"] == b.proc.peer_b58, route
    assert [h["action"] for h in route["hops"]] == ["forward", "serve"], route
    assert relayed.usage.prompt_tokens_details.cached_tokens > 0
    mine = relayed.choices[0].message.tool_calls
    theirs = own_call.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in mine] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in theirs]
    jsonschema.validate(json.loads(mine[0].function.arguments),
                        WEATHER["function"]["parameters"])
    assert relayed.choices[0].finish_reason == "tool_calls"

    wait_until(lambda: _known(a, b, blocks), timeout_s=30, interval_s=0.2,
               what="A to see B idle again")
    text, lps, route = _json_request(a.client())
    assert route["serving"] == b.proc.peer_b58, route
    assert text == own_text
    jsonschema.validate(json.loads(text), TRIP)
    assert [(e.token, e.logprob) for e in lps] == [(e.token, e.logprob) for e in own_lps]
    assert lps and all(len(e.top_logprobs) == 2 for e in lps)
