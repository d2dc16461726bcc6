"""HTTP tenants need keys (issue 14, finding 4): a private namespace is usable over HTTP
only with an API key bound to it (``[http.keys]``) or the gateway-wide key; with no key
configured only public namespaces are served, and the error says how to configure one."""

from __future__ import annotations

import httpx
import pytest
from _gateway import running

from prefixmesh.node.config import load_config
from prefixmesh.node.http_gateway import (
    TENANT_HEADER,
    GatewaySettings,
    resolve_tenant,
    settings_from_config,
)
from prefixmesh.node.openai_schema import PermissionDenied, Unauthorized

KNOWN = ["public", "team"]
CHAT = {"model": "prefixmesh", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}


def test_without_any_key_only_public_tenants_are_served():
    s = GatewaySettings(default_tenant="public", public_tenants=frozenset({"public"}))
    assert resolve_tenant(s, None, None, KNOWN) == "public"
    assert resolve_tenant(s, None, "public", KNOWN) == "public"
    with pytest.raises(Unauthorized) as ei:
        resolve_tenant(s, None, "team", KNOWN)
    assert ei.value.code == "api_key_required"
    assert "[http.keys]" in ei.value.message and "[http].api_key" in ei.value.message
    # a private default tenant is refused too (no header)
    with pytest.raises(Unauthorized):
        resolve_tenant(GatewaySettings(default_tenant="team"), None, None, KNOWN)


def test_a_bound_key_or_the_gateway_key_opens_a_private_tenant():
    s = GatewaySettings(api_keys={"sk-admin": None, "sk-team": "team"},
                        public_tenants=frozenset({"public"}))
    assert resolve_tenant(s, "Bearer sk-team", None, KNOWN) == "team"
    assert resolve_tenant(s, "Bearer sk-team", "team", KNOWN) == "team"
    assert resolve_tenant(s, "Bearer sk-admin", "team", KNOWN) == "team"
    with pytest.raises(Unauthorized):
        resolve_tenant(s, None, "team", KNOWN)
    with pytest.raises(PermissionDenied):
        resolve_tenant(s, "Bearer sk-team", "public", KNOWN)


def test_public_tenants_come_from_the_config():
    cfg = load_config(None, {"http.listen": "127.0.0.1:0"}, text=(
        '[tenants.team]\nsecret = "0123456789abcdef0123"\n'
        '[tenants.open]\nvisibility = "public"\n'))
    assert settings_from_config(cfg).public_tenants == frozenset({"open"})
    # a tenant named "public" that is private is not public
    cfg = load_config(None, {"http.listen": "127.0.0.1:0"}, text=(
        '[tenants.public]\nsecret = "0123456789abcdef0123"\n'))
    s = settings_from_config(cfg)
    assert s.public_tenants == frozenset()
    with pytest.raises(Unauthorized):
        resolve_tenant(s, None, None, ["public"])
    plain = settings_from_config(load_config(None, {"http.listen": "127.0.0.1:0"}))
    assert plain.public_tenants == frozenset({"public"})


def test_over_http_the_header_needs_a_key():
    with running() as (gw, fake):
        r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers={TENANT_HEADER: "team"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "api_key_required"
        r = httpx.post(gw.url + "/api/chat", json={**CHAT, "stream": False},
                       headers={TENANT_HEADER: "team"})
        assert r.status_code == 401
        assert fake.jobs == []
        r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 200
    with running(api_keys={"sk-team": "team"}) as (gw, fake):
        r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT,
                       headers={TENANT_HEADER: "team", "Authorization": "Bearer sk-team"})
        assert r.status_code == 200 and fake.jobs[-1].tenant == "team"
