"""Stable error codes end to end, on a real node with the real model: the same code reaches
the CLI (one line, exit 1) and the HTTP gateway (OpenAI error JSON, the matching status):
``context_length_exceeded`` (400, not a retryable 503) and ``unauthorized`` (a wrong
tenant secret at the CLI; a wrong API key over HTTP, 401)."""

from __future__ import annotations

import subprocess
import sys

import _forkserver
import httpx
import pytest
from _gateway import TEAM_SECRET
from _swarm import Swarm, free_port

pytestmark = pytest.mark.slow

LONG = "The archive keeps letters, maps and ledgers from the harbour town. " * 40
KEY = "gateway-key-for-the-error-test"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    # forked from the pre-imported fork server where it can be (saves ~1.5 s of imports)
    return _forkserver.run([sys.executable, "-m", "prefixmesh", *args], timeout=120)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    root = tmp_path_factory.mktemp("errors")
    port = free_port()
    cfg = root / "node.toml"
    cfg.write_text(f'[http]\nlisten = "127.0.0.1:{port}"\napi_key = "{KEY}"\n'
                   '[tenants.public]\nvisibility = "public"\n'
                   f'[tenants.team]\nsecret = "{TEAM_SECRET}"\n')
    with Swarm(root) as s:
        proc = s.add("A", n_ctx=256, extra=["--config", str(cfg)])
        yield proc, f"http://127.0.0.1:{port}", root


def test_a_prompt_longer_than_every_context_is_a_400_over_http(node):
    _, url, _ = node
    r = httpx.post(url + "/v1/chat/completions", timeout=60,
                   headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "prefixmesh", "max_tokens": 2,
                         "messages": [{"role": "user", "content": LONG}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_a_prompt_longer_than_every_context_is_named_by_the_cli(node):
    proc, _, _ = node
    out = cli("ask", "--peer", proc.addr, "--max-tokens", "2", LONG)
    assert out.returncode == 1
    assert "context_length_exceeded" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_wrong_tenant_secret_is_unauthorized_at_the_cli(node):
    proc, _, root = node
    client_cfg = root / "client.toml"
    client_cfg.write_text('[tenants.team]\nsecret = "not-the-secret-the-node-holds"\n')
    out = cli("ask", "--peer", proc.addr, "--config", str(client_cfg), "--tenant", "team",
              "--max-tokens", "2", "hi")
    assert out.returncode == 1
    assert "unauthorized" in out.stderr, out.stderr


def test_a_wrong_api_key_is_unauthorized_over_http(node):
    _, url, _ = node
    r = httpx.post(url + "/v1/chat/completions", timeout=30,
                   headers={"Authorization": "Bearer wrong"},
                   json={"model": "prefixmesh", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
