"""Issue 14, finding 4, against a real node process (``--backend sim``): a local HTTP
client names a private tenant in ``x-prefixmesh-tenant`` with no API key
(tests/adversary/http_tenant.py, raw sockets). The node has no key configured, so it
serves only public tenants over HTTP: the attacker gets 401 ``api_key_required`` with a
message saying how to configure a key, while an honest client of the public namespace is
answered before and after, and the node keeps running."""

from __future__ import annotations

from _swarm import Swarm, free_port
from adversary.http_tenant import post, use_private_tenant

SECRET = "a-private-team-secret-0123456789"
CHAT = {"model": "prefixmesh", "max_tokens": 2,
        "messages": [{"role": "user", "content": "hello"}]}


def test_private_tenant_header_without_a_key_is_refused(tmp_path):
    port = free_port()
    cfg = tmp_path / "a.toml"
    cfg.write_text(f'[http]\nlisten = "127.0.0.1:{port}"\n'
                   '[tenants.public]\nvisibility = "public"\n'
                   f'[tenants.team]\nsecret = "{SECRET}"\n')
    with Swarm(tmp_path) as s:
        a = s.add("A", backend="sim", extra=["--config", str(cfg)])
        status, body = post("127.0.0.1", port, "/v1/chat/completions", CHAT)
        assert status == 200 and body["choices"], body  # honest, public namespace
        for _ in range(3):
            status, body = use_private_tenant("127.0.0.1", port, "team")
            assert status == 401, body
            assert body["error"]["code"] == "api_key_required", body
            assert "[http.keys]" in body["error"]["message"], body
        # the same header on the Ollama API
        status, body = post("127.0.0.1", port, "/api/chat",
                            {"model": "prefixmesh", "stream": False,
                             "messages": [{"role": "user", "content": "hello"}]},
                            {"x-prefixmesh-tenant": "team"})
        assert status == 401, body
        status, body = post("127.0.0.1", port, "/v1/chat/completions", CHAT)
        assert status == 200 and body["choices"], body
        assert a.proc.poll() is None, a.log_tail()
