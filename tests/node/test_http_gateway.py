"""The HTTP gateway end to end over real HTTP (hypercorn on loopback), against a fake
GatewayBackend: the official ``openai`` client for the happy paths, raw HTTP (httpx and
sockets) for malformed input, limits and client disconnects.

The gateway runs in its own thread with its own trio loop (the test's client is
synchronous); the fake backend's counters are read across threads (plain ints).
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest
import trio
from _gateway import (  # noqa: E402
    MODEL,
    ROUTE,
    FakeBackend,
    client,
    running,
    wait_until,
)

from prefixmesh.node.http_gateway import (
    ROUTE_HEADER,
    TENANT_HEADER,
    GatewayConfigError,
    GatewaySettings,
    check_bind,
    resolve_tenant,
    serve_http,
)
from prefixmesh.node.openai_schema import (
    DeadlineExceeded,
    NoCapacity,
    NotFound,
    PermissionDenied,
    Unauthorized,
)


def error_of(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


FULL = "Hello world. Bye now"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]


# --- the official client: happy paths ---------------------------------------------------


def test_the_route_says_whether_the_answer_was_decoded_in_a_shared_batch():
    from prefixmesh.node.http_gateway import _route_header, route_json
    from prefixmesh.overlay.core import wire
    from prefixmesh.overlay.core.identity import peer_id_from_public_key

    peer = peer_id_from_public_key(b"\x07" * 32)
    hop = wire.Hop(peer=peer, action="serve", reason="local", local_matched_tokens=16,
                   ttft_ms=3.0)
    for batched in (False, True):
        final = wire.Final(id=b"\1" * 16, entry=peer, serving=peer, prompt_tokens=20,
                           cached_tokens=16, completion_tokens=4, ttft_ms=3.0, total_ms=9.0,
                           finish_reason="stop", hops=(hop,), batched=batched)
        route = route_json(final)
        assert route["batched"] is batched and route["hops"][0]["matched"] == 16
        assert json.loads(_route_header(route))["batched"] is batched


def test_models_list_and_retrieve():
    with running() as (gw, _):
        c = client(gw)
        assert [m.id for m in c.models.list()] == [MODEL, "prefixmesh"]
        assert c.models.retrieve(MODEL).id == MODEL
        with pytest.raises(openai.NotFoundError):
            c.models.retrieve("gpt-17")


def test_chat_non_streaming_reports_usage_cache_and_route():
    with running() as (gw, fake):
        c = client(gw)
        raw = c.chat.completions.with_raw_response.create(
            model=MODEL, messages=CHAT, max_tokens=50, temperature=0.5, top_p=0.9, seed=7)
        resp = raw.parse()
        assert resp.object == "chat.completion"
        assert resp.choices[0].message.role == "assistant"
        assert resp.choices[0].message.content == FULL
        assert resp.choices[0].finish_reason == "stop"
        assert resp.usage.prompt_tokens == len("<system>You are terse.<user>Hi")
        assert resp.usage.completion_tokens == 5
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + 5
        assert resp.usage.prompt_tokens_details.cached_tokens == 0
        assert resp.model_extra["prefixmesh"]["route"] == ROUTE
        header = json.loads(raw.headers[ROUTE_HEADER])
        assert header["serving"] == ROUTE["serving"]
        assert [h["action"] for h in header["hops"]] == ["forward", "serve"]
        assert "reason" not in header["hops"][0]  # free text stays out of headers
        job = fake.jobs[-1]
        assert job.messages == (("system", "You are terse."), ("user", "Hi"))
        s = job.sampling
        assert (s.max_tokens, s.temperature, s.top_p, s.seed) == (50, 0.5, 0.9, 7)
        assert job.tenant == "public"

        # a second request sharing the prefix: the backend's cache figure comes through
        again = c.chat.completions.create(
            model=MODEL, messages=[*CHAT[:1], {"role": "user", "content": "Hello"}])
        assert again.usage.prompt_tokens_details.cached_tokens == len("<system>You are terse.<user>H")


def test_chat_streaming_chunks_usage_and_done():
    with running() as (gw, fake):
        c = client(gw)
        chunks = list(c.chat.completions.create(
            model=MODEL, messages=CHAT, stream=True, stream_options={"include_usage": True}))
        assert all(ch.object == "chat.completion.chunk" for ch in chunks)
        assert len({ch.id for ch in chunks}) == 1
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == FULL
        finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        assert len(finals) == 1 and finals[0].choices[0].finish_reason == "stop"
        assert finals[0].model_extra["prefixmesh"]["route"] == ROUTE
        usage_chunk = chunks[-1]
        assert usage_chunk.choices == []
        assert usage_chunk.usage.completion_tokens == 5
        assert usage_chunk.usage.prompt_tokens_details.cached_tokens == 0
        assert all(ch.usage is None for ch in chunks[:-1])
        assert fake.finished == 1 and fake.active == 0


def test_streaming_raw_ends_with_done():
    with running() as (gw, _):
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json={
                "model": MODEL, "messages": CHAT, "stream": True}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = [ln for ln in r.iter_lines() if ln]
        assert lines[-1] == "data: [DONE]"
        assert all(ln.startswith("data: ") for ln in lines)
        # without include_usage no chunk has a usage field
        assert all("usage" not in json.loads(ln[6:]) for ln in lines[:-1])


def test_completions_non_streaming_and_streaming():
    with running() as (gw, fake):
        c = client(gw)
        resp = c.completions.create(model=MODEL, prompt="Once upon", max_tokens=3)
        assert resp.object == "text_completion"
        assert resp.choices[0].text == "Hello world."
        assert resp.choices[0].finish_reason == "length"
        assert resp.usage.completion_tokens == 3
        assert fake.jobs[-1].prompt == "Once upon" and fake.jobs[-1].messages == ()
        chunks = list(c.completions.create(model=MODEL, prompt="Once upon a", stream=True,
                                           stream_options={"include_usage": True}))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == FULL
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == len("Once upon")


def test_stop_sequence_cuts_text_and_cancels_generation():
    with running() as (gw, fake):
        c = client(gw)
        resp = c.chat.completions.create(model=MODEL, messages=CHAT, stop=[". B", "zzz"])
        assert resp.choices[0].message.content == "Hello world"
        assert resp.choices[0].finish_reason == "stop"
        assert resp.usage.completion_tokens == 4  # "Hello", " world", ".", " Bye"
        assert resp.model_extra["prefixmesh"]["stopped_at_gateway"] is True
        assert wait_until(lambda: fake.cancelled == 1 and fake.active == 0)
        chunks = list(c.chat.completions.create(model=MODEL, messages=CHAT, stream=True,
                                                stop="world"))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) \
            == "Hello "
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_stop_sequence_reports_the_serving_nodes_counts():
    """A stop ends the request before the serving node's final statistics: the usage has
    the counts that node said with its first text (for another model's request the entry
    never knows them), in the OpenAI usage and in Ollama's prompt_eval_count; a cached
    count nobody said is flagged as unknown."""
    with running() as (gw, fake):
        c = client(gw)
        fake.counts_first = True
        prompt = "".join(f"<{m['role']}>{m['content']}" for m in CHAT)
        for i in range(2):  # the second time the prompt is cached (the fake's prefix rule)
            resp = c.chat.completions.create(model=MODEL, messages=CHAT, stop=[". B"])
            assert resp.choices[0].message.content == "Hello world"
            assert resp.usage.prompt_tokens == len(prompt)
            assert resp.usage.prompt_tokens_details.cached_tokens == (len(prompt) if i else 0)
            assert "cached_tokens_unknown" not in resp.model_extra["prefixmesh"]
        chunks = list(c.completions.create(model=MODEL, prompt="Once upon", stream=True,
                                           stop="world", stream_options={"include_usage": True}))
        assert chunks[-1].usage.prompt_tokens == len("Once upon")
        r = httpx.post(gw.url + "/api/chat", timeout=10, json={
            "model": MODEL, "messages": CHAT, "stream": False, "options": {"stop": [". B"]}})
        assert r.status_code == 200, r.text
        assert r.json()["message"]["content"] == "Hello world"
        assert r.json()["prompt_eval_count"] == len(prompt)
        fake.counts_first = False  # the entry tokenized; nobody said the cached count
        resp = c.chat.completions.create(model=MODEL, messages=CHAT, stop=[". B"])
        assert resp.usage.prompt_tokens == len(prompt)
        assert resp.usage.prompt_tokens_details.cached_tokens == 0
        assert resp.model_extra["prefixmesh"]["cached_tokens_unknown"] is True


# --- tenants and keys ----------------------------------------------------------------------


def test_api_keys_and_tenant_selection():
    keys = {"sk-admin": None, "sk-team": "team"}
    with running(api_keys=keys) as (gw, fake):
        with pytest.raises(openai.AuthenticationError) as ei:
            client(gw, key="sk-wrong").models.list()
        assert ei.value.status_code == 401
        assert ei.value.body["code"] == "invalid_api_key"
        r = httpx.get(gw.url + "/v1/models")
        assert r.status_code == 401 and error_of(r)["code"] == "missing_api_key"

        client(gw, key="sk-team").chat.completions.create(model=MODEL, messages=CHAT)
        assert fake.jobs[-1].tenant == "team"
        client(gw, key="sk-admin").chat.completions.create(model=MODEL, messages=CHAT)
        assert fake.jobs[-1].tenant == "public"
        client(gw, key="sk-admin", default_headers={TENANT_HEADER: "team"}) \
            .chat.completions.create(model=MODEL, messages=CHAT)
        assert fake.jobs[-1].tenant == "team"
        with pytest.raises(openai.PermissionDeniedError):
            client(gw, key="sk-team", default_headers={TENANT_HEADER: "public"}) \
                .chat.completions.create(model=MODEL, messages=CHAT)
        with pytest.raises(openai.NotFoundError) as ei:
            client(gw, key="sk-admin", default_headers={TENANT_HEADER: "nope"}) \
                .chat.completions.create(model=MODEL, messages=CHAT)
        assert ei.value.body["code"] == "tenant_not_found"
        assert httpx.get(gw.url + "/healthz").status_code == 200  # no key needed


def test_resolve_tenant_rules():
    s = GatewaySettings(api_keys={"a": None, "b": "team"}, default_tenant="public")
    known = ["public", "team"]
    assert resolve_tenant(s, "Bearer a", None, known) == "public"
    assert resolve_tenant(s, "bearer  b ", None, known) == "team"
    assert resolve_tenant(s, "Bearer a", "team", known) == "team"
    for auth in (None, "", "Bearer", "Basic a", "Bearer c"):
        with pytest.raises(Unauthorized):
            resolve_tenant(s, auth, None, known)
    with pytest.raises(PermissionDenied):
        resolve_tenant(s, "Bearer b", "public", known)
    with pytest.raises(NotFound):
        resolve_tenant(s, "Bearer a", "other", known)
    open_settings = GatewaySettings(default_tenant="public")
    assert resolve_tenant(open_settings, None, "public", known) == "public"
    assert resolve_tenant(open_settings, "Bearer whatever", None, known) == "public"
    with pytest.raises(Unauthorized):  # a private tenant over HTTP needs a key (issue 14.4)
        resolve_tenant(open_settings, None, "team", known)


def test_non_loopback_bind_requires_a_key():
    with pytest.raises(GatewayConfigError):
        check_bind(GatewaySettings(listen="0.0.0.0:8080"))
    with pytest.raises(GatewayConfigError):
        check_bind(GatewaySettings(listen="192.168.1.5:8080"))
    with pytest.raises(GatewayConfigError):
        check_bind(GatewaySettings(listen="nonsense"))
    check_bind(GatewaySettings(listen="0.0.0.0:8080", api_keys={"k": None}))
    check_bind(GatewaySettings(listen="127.0.0.1:8080"))
    check_bind(GatewaySettings(listen="[::1]:8080"))
    check_bind(GatewaySettings(listen="localhost:0"))
    with pytest.raises(GatewayConfigError):
        trio.run(serve_http, FakeBackend(), GatewaySettings(listen="0.0.0.0:0"))


# --- errors ------------------------------------------------------------------------------


def test_malformed_requests_get_openai_errors_and_node_keeps_serving():
    with running(max_body_bytes=64 * 1024) as (gw, fake):
        url = gw.url + "/v1/chat/completions"
        cases = [
            (b"{not json", 400, "invalid_json", None),
            (b"[1, 2]", 400, "invalid_json", None),
            (b"\xff\xfe", 400, "invalid_json", None),
            (b"", 400, "invalid_json", None),
            (b"[" * 5000 + b"]" * 5000, 400, "invalid_json", None),
        ]
        for body, status, code, param in cases:
            r = httpx.post(url, content=body, headers={"content-type": "application/json"})
            assert r.status_code == status, body[:20]
            e = error_of(r)
            assert e["code"] == code and e["param"] == param and e["type"] == "invalid_request_error"
        bad_json = [
            ({"model": MODEL}, "messages", "missing_required_parameter"),
            ({"messages": CHAT}, "model", "missing_required_parameter"),
            ({"model": 5, "messages": CHAT}, "model", "invalid_type"),
            ({"model": MODEL, "messages": "hi"}, "messages", "invalid_type"),
            ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
             "messages[0].role", "invalid_value"),
            ({"model": MODEL, "messages": CHAT, "temperature": "hot"}, "temperature",
             "invalid_type"),
            ({"model": MODEL, "messages": CHAT, "temperature": 2.5}, "temperature",
             "invalid_value"),
            ({"model": MODEL, "messages": CHAT, "top_p": 1.5}, "top_p", "invalid_value"),
            ({"model": MODEL, "messages": CHAT, "max_tokens": 0}, "max_tokens", "invalid_value"),
            ({"model": MODEL, "messages": CHAT, "max_tokens": True}, "max_tokens",
             "invalid_type"),
            ({"model": MODEL, "messages": CHAT, "seed": -1}, "seed", "invalid_value"),
            ({"model": MODEL, "messages": CHAT, "stop": ["a", 3]}, "stop[1]", "invalid_type"),
            ({"model": MODEL, "messages": CHAT, "n": 2}, "n", "unsupported_value"),
            ({"model": MODEL, "messages": CHAT, "stream": "yes"}, "stream", "invalid_type"),
        ]
        for body, param, code in bad_json:
            r = httpx.post(url, json=body)
            assert r.status_code == 400, body
            e = error_of(r)
            assert (e["param"], e["code"]) == (param, code), body
        assert fake.jobs == []  # nothing reached the backend

        r = httpx.post(url, json={"model": "gpt-17", "messages": CHAT})
        assert r.status_code == 404 and error_of(r)["code"] == "model_not_found"
        assert error_of(r)["param"] == "model"
        r = httpx.get(gw.url + "/v1/nothing-here")
        assert r.status_code == 404 and error_of(r)["code"] == "unknown_url"
        r = httpx.get(url)
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        assert error_of(r)["code"] == "method_not_allowed"
        r = httpx.delete(gw.url + "/v1/models")
        assert r.status_code == 405 and r.headers["allow"] == "GET"

        # oversize: declared by Content-Length ...
        r = httpx.post(url, json={"model": MODEL, "messages": [
            {"role": "user", "content": "x" * 100_000}]})
        assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"

        # ... and chunked, counted while reading
        def pieces():
            yield b'{"model": "fake-model", "messages": [{"role": "user", "content": "'
            for _ in range(40):
                yield b"y" * 4096
            yield b'"}]}'

        r = httpx.post(url, content=pieces(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"

        # the official client sees the same statuses as typed exceptions
        c = client(gw)
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model="gpt-17", messages=CHAT)
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model=MODEL, messages=CHAT, temperature=9)
        with pytest.raises(openai.APIStatusError) as ei:
            c.chat.completions.create(model=MODEL, messages=[
                {"role": "user", "content": "z" * 200_000}])
        assert ei.value.status_code == 413

        # and the gateway still serves
        ok = c.chat.completions.create(model=MODEL, messages=CHAT)
        assert ok.choices[0].message.content == FULL


def test_missing_key_on_post_with_body():
    with running(api_keys={"sk": None}) as (gw, fake):
        r = httpx.post(gw.url + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT})
        assert r.status_code == 401 and error_of(r)["code"] == "missing_api_key"
        assert fake.jobs == []
        ok = client(gw, key="sk").chat.completions.create(model=MODEL, messages=CHAT)
        assert ok.choices[0].message.content == FULL


@pytest.mark.parametrize(("failure", "status", "exc"), [
    (NoCapacity("overloaded: engine queue full", code="overloaded"), 503,
     openai.InternalServerError),
    (DeadlineExceeded("deadline: expired", code="deadline"), 504, openai.InternalServerError),
])
def test_backend_failures_map_to_status(failure, status, exc):
    with running() as (gw, fake):
        fake.fail = failure
        r = httpx.post(gw.url + "/v1/chat/completions",
                       json={"model": MODEL, "messages": CHAT, "stream": True})
        assert r.status_code == status
        assert error_of(r)["code"] == failure.code
        with pytest.raises(exc) as ei:
            client(gw).chat.completions.create(model=MODEL, messages=CHAT)
        assert ei.value.status_code == status
        fake.fail = None
        assert client(gw).chat.completions.create(model=MODEL, messages=CHAT).choices


def test_error_after_stream_started_is_an_sse_error_event():
    with running() as (gw, fake):
        fake.fail_after_tokens = NoCapacity("upstream_failed: node died", code="upstream_failed")
        with httpx.stream("POST", gw.url + "/v1/chat/completions",
                          json={"model": MODEL, "messages": CHAT, "stream": True}) as r:
            assert r.status_code == 200
            lines = [ln for ln in r.iter_lines() if ln]
        assert "[DONE]" not in lines[-1]
        assert json.loads(lines[-1][6:])["error"]["code"] == "upstream_failed"
        with pytest.raises(openai.APIError):
            list(client(gw).chat.completions.create(model=MODEL, messages=CHAT, stream=True))


def test_gateway_deadline_gives_504():
    backend = FakeBackend()
    backend.forever = True
    backend.delay_s = 0.05
    with running(backend, deadline_s=0.2) as (gw, fake):
        r = httpx.post(gw.url + "/v1/chat/completions",
                       json={"model": MODEL, "messages": CHAT, "max_tokens": 10_000}, timeout=20)
        assert r.status_code == 504 and error_of(r)["code"] == "deadline_exceeded"
        assert wait_until(lambda: fake.active == 0 and fake.cancelled == 1)


def test_concurrency_limit_gives_503():
    backend = FakeBackend()
    backend.forever = True
    backend.delay_s = 0.02
    with running(backend, max_concurrent=1) as (gw, fake):
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json={
                "model": MODEL, "messages": CHAT, "stream": True, "max_tokens": 10_000}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # keep the iterator: closing it closes the connection
            next(lines)
            second = httpx.post(gw.url + "/v1/chat/completions",
                                json={"model": MODEL, "messages": CHAT})
            assert second.status_code == 503 and error_of(second)["code"] == "no_capacity"
        assert wait_until(lambda: fake.active == 0)


# --- disconnects -------------------------------------------------------------------------


def _raw_stream_request(port: int) -> socket.socket:
    body = json.dumps({"model": MODEL, "messages": CHAT, "stream": True,
                       "max_tokens": 30_000}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


def test_client_disconnect_mid_stream_cancels_generation():
    backend = FakeBackend()
    backend.forever = True
    backend.delay_s = 0.01
    with running(backend) as (gw, fake):
        port = int(gw.url.rsplit(":", 1)[1])
        sock = _raw_stream_request(port)
        got = b""
        while got.count(b"data: ") < 5:
            got += sock.recv(65536)
        assert b"200" in got.split(b"\r\n", 1)[0]
        assert fake.active == 1
        sock.close()
        assert wait_until(lambda: fake.active == 0 and fake.cancelled == 1)
        produced = fake.tokens_generated
        time.sleep(0.3)
        assert fake.tokens_generated == produced  # nothing generated for nobody
        status = httpx.get(gw.url + "/prefixmesh/status").json()
        assert status["gateway"]["disconnects"] == 1 and status["gateway"]["active"] == 0
        # still serving
        assert client(gw).chat.completions.create(model=MODEL, messages=CHAT).choices


def test_client_disconnect_while_waiting_non_streaming():
    backend = FakeBackend()
    backend.forever = True
    backend.delay_s = 0.01
    with running(backend) as (gw, fake):
        port = int(gw.url.rsplit(":", 1)[1])
        body = json.dumps({"model": MODEL, "messages": CHAT, "max_tokens": 30_000}).encode()
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert wait_until(lambda: fake.tokens_generated > 3)
        sock.close()
        assert wait_until(lambda: fake.active == 0 and fake.cancelled == 1)


def test_slow_body_gets_408():
    with running(body_timeout_s=0.5) as (gw, fake):
        port = int(gw.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Length: 100\r\n\r\n{\"model\":")
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                data = sock.recv(65536)
                if not data:
                    break
                reply += data
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408")
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert fake.jobs == []


def test_settings_from_config():
    from prefixmesh.node.config import load_config
    from prefixmesh.node.http_gateway import settings_from_config

    cfg = load_config(None, {"http.listen": "127.0.0.1:0"}, text=(
        '[http]\napi_key = "sk-local-admin"\n[routing]\ndeadline_s = 12.5\n'
        '[client]\nmax_tokens = 77\ntenant = "team"\n'
        '[tenants.team]\nsecret = "0123456789abcdef0123"\n'
        '[tenants.public]\nvisibility = "public"\n'))
    s = settings_from_config(cfg)
    assert s.listen == "127.0.0.1:0"
    assert dict(s.api_keys) == {"sk-local-admin": None}
    assert s.default_tenant == "team"
    assert s.deadline_s == 12.5 and s.default_max_tokens == 77
    plain = settings_from_config(load_config(None, {"http.listen": "127.0.0.1:8080"}))
    assert dict(plain.api_keys) == {} and plain.default_tenant == "public"
    check_bind(plain)


def test_completed_requests_are_not_counted_as_disconnects():
    with running() as (gw, fake):
        for _ in range(5):
            assert httpx.post(gw.url + "/v1/chat/completions",
                              json={"model": MODEL, "messages": CHAT}).status_code == 200
            with httpx.stream("POST", gw.url + "/v1/chat/completions",
                              json={"model": MODEL, "messages": CHAT, "stream": True}) as r:
                assert list(r.iter_lines())[-2] == "data: [DONE]"
        assert wait_until(lambda: fake.active == 0)
        status = httpx.get(gw.url + "/prefixmesh/status").json()
        assert status["gateway"]["disconnects"] == 0
        assert fake.finished == 10 and fake.cancelled == 0


def test_address_in_use_is_a_config_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(GatewayConfigError, match="cannot listen"):
            trio.run(serve_http, FakeBackend(), GatewaySettings(listen=f"127.0.0.1:{port}"))
