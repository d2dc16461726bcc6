"""Two models in one mesh, real node processes and real models (issue 18).

Node A serves the embedded SmolLM2-135M-Instruct Q4_1; node B serves its Q4_0
requantization (tests/_second_model.py: another GGUF fingerprint). A request for model B
entered at A (its HTTP gateway, or the libp2p client) is passed to B, never served or
matched at A, and B's prefix cache answers the second one; so is a raw-prompt completion
(its text travels, B tokenizes it); ``GET /v1/models`` on A lists
both models with their node counts; a model nobody serves is a 404 ``model_not_found``
(HTTP) and a clear ``ModelNotFound`` (client). Figures: docs/BENCHMARKS.md, "Two models".
"""

from __future__ import annotations

import time

import httpx
import pytest
import trio
from _gateway import HttpNode
from _second_model import SECOND_MODEL_NAME, second_model_path
from _swarm import Swarm, ask, wait_until

from prefixmesh.node.client import Client, ModelNotFound
from prefixmesh.overlay.core.identity import peer_id_to_b58

pytestmark = pytest.mark.slow

FIRST_MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1"
SYSTEM = ("You are a lighthouse keeper's assistant. Answer in one short sentence. The "
          "lighthouse stands on a rock in the northern sea and guides the fishing boats. ") * 4


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    path_b = second_model_path()  # made (or found) before any node starts
    with Swarm(tmp_path_factory.mktemp("twomodels")) as s:
        a = HttpNode(s, "A", n_ctx=1024)
        b = s.add("B", bootstrap=[a.proc.addr], n_ctx=1024, extra=["--model", str(path_b)])
        wait_until(lambda: _nodes_by_name(a) == {FIRST_MODEL_NAME: 1, SECOND_MODEL_NAME: 1},
                   timeout_s=60, what="A's /v1/models to list both models")
        yield a, b, s


def _models(a: HttpNode) -> list[dict]:
    return httpx.get(a.url + "/v1/models", timeout=10).json()["data"]


def _nodes_by_name(a: HttpNode) -> dict[str, int]:
    return {m["id"]: m["prefixmesh"]["nodes"] for m in _models(a) if m["id"] != "prefixmesh"}


def _chat(a: HttpNode, model: str, question: str) -> tuple[httpx.Response, float]:
    t0 = time.perf_counter()
    r = httpx.post(a.url + "/v1/chat/completions", timeout=120, json={
        "model": model, "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]})
    return r, time.perf_counter() - t0


def test_models_lists_both_with_fingerprints_and_counts(mesh):
    a, b, _ = mesh
    listed = {m["id"]: m["prefixmesh"] for m in _models(a)}
    assert listed[FIRST_MODEL_NAME]["local"] and listed["prefixmesh"]["local"]
    assert not listed[SECOND_MODEL_NAME]["local"]
    assert listed[FIRST_MODEL_NAME]["fingerprint"] != listed[SECOND_MODEL_NAME]["fingerprint"]
    fp_b = listed[SECOND_MODEL_NAME]["fingerprint"]
    one = httpx.get(f"{a.url}/v1/models/{fp_b}", timeout=10).json()
    assert one["id"] == SECOND_MODEL_NAME


def test_model_b_at_a_is_served_by_b_with_cached_tokens_the_second_time(mesh):
    a, b, _ = mesh
    first, t1 = _chat(a, SECOND_MODEL_NAME, "What does the lighthouse do?")
    assert first.status_code == 200, first.text
    body = first.json()
    route = body["prefixmesh"]["route"]
    assert route["serving"] == b.peer_b58 and route["entry"] == a.proc.peer_b58
    assert route["hops"][0]["action"] == "forward"
    assert "model relay" in route["hops"][0]["reason"]
    assert body["model"] == SECOND_MODEL_NAME
    # the same system prompt, another question, named by fingerprint this time
    fp_b = next(m["prefixmesh"]["fingerprint"] for m in _models(a)
                if m["id"] == SECOND_MODEL_NAME)
    second, t2 = _chat(a, fp_b, "Who does it guide?")
    assert second.status_code == 200, second.text
    usage = second.json()["usage"]
    assert second.json()["prefixmesh"]["route"]["serving"] == b.peer_b58
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0, usage
    status = httpx.get(a.url + "/prefixmesh/status", timeout=10).json()["infer"]
    assert status.get("model_relayed", 0) >= 2
    assert status["served_local"] == 0  # A never served (nor matched) model B's requests
    print(f"\ntwo models: model B via A, first {t1:.2f} s, second {t2:.2f} s, cached "
          f"{usage['prompt_tokens_details']['cached_tokens']}/{usage['prompt_tokens']} tokens")


def _complete(a: HttpNode, model: str, prompt: str) -> tuple[httpx.Response, float]:
    t0 = time.perf_counter()
    r = httpx.post(a.url + "/v1/completions", timeout=120, json={
        "model": model, "max_tokens": 4, "temperature": 0, "prompt": prompt})
    return r, time.perf_counter() - t0


def test_a_raw_prompt_for_model_b_at_a_is_tokenized_and_served_by_b(mesh):
    """A raw-prompt completion travels as text (A's tokenizer is A's) and B tokenizes it."""
    a, b, _ = mesh
    served_before = _infer_stats(a)["served_local"]
    text = "Lighthouse log. " + SYSTEM + "Entry for tonight:"
    first, t1 = _complete(a, SECOND_MODEL_NAME, text)
    assert first.status_code == 200, first.text
    body = first.json()
    route = body["prefixmesh"]["route"]
    assert route["serving"] == b.peer_b58 and route["entry"] == a.proc.peer_b58
    assert "model relay" in route["hops"][0]["reason"]
    assert body["model"] == SECOND_MODEL_NAME and body["object"] == "text_completion"
    # B's tokenizer, not a byte count: the same text as chat content is about as long
    assert 0 < body["usage"]["prompt_tokens"] < len(text) / 2
    second, t2 = _complete(a, SECOND_MODEL_NAME, text + " calm seas")
    assert second.status_code == 200, second.text
    usage = second.json()["usage"]
    assert second.json()["prefixmesh"]["route"]["serving"] == b.peer_b58
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0, usage
    assert _infer_stats(a)["served_local"] == served_before  # never served at A
    r = httpx.post(a.url + "/v1/completions", timeout=30, json={
        "model": "no-such-model", "max_tokens": 2, "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    print(f"\ntwo models, raw prompt: model B via A, first {t1:.2f} s, second {t2:.2f} s, "
          f"cached {usage['prompt_tokens_details']['cached_tokens']}/{usage['prompt_tokens']}")


def _infer_stats(a: HttpNode) -> dict:
    return httpx.get(a.url + "/prefixmesh/status", timeout=10).json()["infer"]


def test_the_client_names_a_model_and_a_missing_one_is_clear(mesh):
    a, b, _ = mesh
    ans = ask(a.proc.addr, [("system", SYSTEM), ("user", "Is the sea calm?")], max_tokens=3,
              model=SECOND_MODEL_NAME)
    assert peer_id_to_b58(ans.final.serving) == b.peer_b58
    own = ask(a.proc.addr, [("user", "Hello")], max_tokens=3)
    assert peer_id_to_b58(own.final.serving) == a.proc.peer_b58

    async def missing():
        async with Client.connect(a.proc.addr) as c:
            with pytest.raises(ModelNotFound) as err:
                await c.ask([("user", "hi")], model="no-such-model")
            assert SECOND_MODEL_NAME in str(err.value)

    trio.run(missing)


def test_a_model_nobody_serves_is_a_404(mesh):
    a, _, _ = mesh
    r, _ = _chat(a, "no-such-model", "hi")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    assert r.json()["error"]["param"] == "model"
    r = httpx.get(a.url + "/v1/models/no-such-model", timeout=10)
    assert r.status_code == 404


def test_a_stop_sequence_for_model_b_at_a_keeps_bs_prompt_count(mesh):
    """A stop sequence ends the request at A's gateway before B's FINAL: the usage still
    has B's token count of the prompt and its cached count, which B sent with its first
    token (A cannot count them: B's tokenizer is B's)."""
    a, b, _ = mesh
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Name three things the keeper does."}]

    def chat(stop=None):
        body = {"model": SECOND_MODEL_NAME, "max_tokens": 8, "temperature": 0,
                "messages": messages}
        if stop:
            body["stop"] = stop
        r = httpx.post(a.url + "/v1/chat/completions", timeout=120, json=body)
        assert r.status_code == 200, r.text
        return r.json()

    full = chat()
    text = full["choices"][0]["message"]["content"]
    words = text.split()
    assert len(words) >= 3, text
    cut = chat(stop=[words[2]])
    assert cut["prefixmesh"].get("stopped_at_gateway") is True, cut
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert len(cut["choices"][0]["message"]["content"]) < len(text)
    assert cut["usage"]["prompt_tokens"] == full["usage"]["prompt_tokens"] > 0
    # the same prompt again: B's cache served most of it, and B said so with its first token
    assert cut["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, cut["usage"]
    assert "cached_tokens_unknown" not in cut["prefixmesh"]
    print(f"\ntwo models, stopped at A: prompt {cut['usage']['prompt_tokens']} tokens, cached "
          f"{cut['usage']['prompt_tokens_details']['cached_tokens']}")
