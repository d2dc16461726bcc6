"""The operator endpoints of the HTTP gateway over real HTTP (hypercorn on loopback) with a
stand-in backend: the dashboard's static files (package data, strict CSP, no key needed),
``/metrics`` and ``/prefixmesh/overview`` behind the unbound API key, and the
metrics-only listener (``[metrics] listen``) that refuses the OpenAI API.

The real node and a real browser: tests/test_dashboard_browser.py."""

from __future__ import annotations

import contextlib
import functools
import threading

import httpx
import pytest
import trio
from _gateway import FakeBackend  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families

from prefixmesh.node.http_gateway import GatewaySettings, check_operator, serve_http
from prefixmesh.node.metrics import NodeMetrics
from prefixmesh.node.openai_schema import PermissionDenied, Unauthorized
from prefixmesh.overlay.core.identity import Identity

ME = Identity.from_seed(b"\3" * 32)


class OpsBackend(FakeBackend):
    def __init__(self):
        super().__init__()
        self.metrics = NodeMetrics(self_id=ME.peer_id)

    def metrics_text(self) -> bytes:
        return self.metrics.exposition()

    def overview(self) -> dict:
        return {"node": {"peer_id": ME.peer_id_b58}, "peers": [], "namespaces": [],
                "recent": []}


@contextlib.contextmanager
def gateway(backend, *, api: bool = True, **settings):
    settings.setdefault("listen", "127.0.0.1:0")
    state: dict = {}
    ready = threading.Event()

    async def main():
        with trio.CancelScope() as cs:
            state["cancel"], state["token"] = cs, trio.lowlevel.current_trio_token()
            async with trio.open_nursery() as n:
                state["url"] = await n.start(functools.partial(
                    serve_http, backend, GatewaySettings(**settings), api=api))
                ready.set()

    t = threading.Thread(target=lambda: trio.run(main), daemon=True)
    t.start()
    assert ready.wait(10), "gateway did not start"
    try:
        yield state["url"]
    finally:
        with contextlib.suppress(trio.RunFinishedError):
            trio.from_thread.run_sync(state["cancel"].cancel, trio_token=state["token"])
        t.join(10)


def test_dashboard_files_are_served_from_the_package_with_a_strict_csp():
    with gateway(OpsBackend(), api_keys={"op": None}) as url:
        for path, ctype in (("/dashboard", "text/html"), ("/dashboard/", "text/html"),
                            ("/dashboard/app.js", "text/javascript"),
                            ("/dashboard/style.css", "text/css")):
            r = httpx.get(url + path)  # no key: the files carry no data
            assert r.status_code == 200, path
            assert r.headers["content-type"].startswith(ctype)
            assert "script-src 'self'" in r.headers["content-security-policy"]
            assert r.headers["x-content-type-options"] == "nosniff"
        page = httpx.get(url + "/dashboard").text
        assert "/dashboard/app.js" in page and "http" not in page.split("<body>")[1].lower()
        assert httpx.get(url + "/dashboard/nope.js").status_code == 404
        assert httpx.get(url + "/dashboard/../http_gateway.py").status_code == 404
        assert httpx.get(url + "/dashboard/__init__.py").status_code == 404
        assert httpx.post(url + "/dashboard", content=b"x").status_code == 405


def test_operator_endpoints_need_the_unbound_key():
    backend = OpsBackend()
    with gateway(backend, api_keys={"op": None, "tenant-key": "team"}) as url:
        for path in ("/metrics", "/prefixmesh/overview"):
            assert httpx.get(url + path).status_code == 401
            assert httpx.get(url + path, headers={"authorization": "Bearer nope"}
                             ).status_code == 401
            r = httpx.get(url + path, headers={"authorization": "Bearer tenant-key"})
            assert r.status_code == 403 and r.json()["error"]["type"]
            assert httpx.get(url + path, headers={"authorization": "Bearer op"}
                             ).status_code == 200
        r = httpx.get(url + "/metrics", headers={"authorization": "Bearer op"})
        assert r.headers["content-type"].startswith("text/plain")
        names = {f.name for f in text_string_to_metric_families(r.text)}
        assert "prefixmesh:requests" in names
        ov = httpx.get(url + "/prefixmesh/overview", headers={"authorization": "Bearer op"}).json()
        assert ov["node"]["peer_id"] == ME.peer_id_b58 and ov["gateway"]["active"] == 0


def test_no_key_configured_means_open_on_loopback():
    with gateway(OpsBackend()) as url:
        assert httpx.get(url + "/metrics").status_code == 200
        assert httpx.get(url + "/prefixmesh/overview").status_code == 200


def test_metrics_only_listener_refuses_the_openai_api():
    with gateway(OpsBackend(), api=False) as url:
        assert httpx.get(url + "/metrics").status_code == 200
        assert httpx.get(url + "/dashboard").status_code == 200
        assert httpx.get(url + "/healthz").status_code == 200
        r = httpx.get(url + "/v1/models")
        assert r.status_code == 404 and "only /metrics" in r.json()["error"]["message"]
        assert httpx.post(url + "/v1/chat/completions", json={}).status_code == 404


def test_backend_without_operator_methods_gives_404():
    with gateway(FakeBackend()) as url:
        assert httpx.get(url + "/metrics").status_code == 404
        assert httpx.get(url + "/prefixmesh/overview").status_code == 404


def test_check_operator_rules():
    open_ = GatewaySettings()
    check_operator(open_, None)
    keyed = GatewaySettings(api_keys={"k": None})
    check_operator(keyed, "Bearer k")
    for bad in (None, "Basic k", "Bearer", "Bearer x"):
        with pytest.raises(Unauthorized):
            check_operator(keyed, bad)
    with pytest.raises(PermissionDenied):
        check_operator(GatewaySettings(api_keys={"k": "team"}), "Bearer k")


def test_metrics_listen_config(tmp_path):
    from prefixmesh.node.config import ConfigError, load_config

    path = tmp_path / "node.toml"
    path.write_text('[metrics]\nlisten = "127.0.0.1:9464"\n')
    assert load_config(path).metrics.listen == "127.0.0.1:9464"
    path.write_text('[metrics]\nlisten = "0.0.0.0:9464"\n')
    with pytest.raises(ConfigError, match=r"metrics.*api_key"):
        load_config(path)
    path.write_text('[metrics]\nlisten = "0.0.0.0:9464"\n[http]\napi_key = "k"\n')
    assert load_config(path).metrics.listen == "0.0.0.0:9464"
    path.write_text('[metrics]\nlisten = "nonsense"\n')
    with pytest.raises(ConfigError, match="metrics"):
        load_config(path)


class MeshOpsBackend(OpsBackend):
    """An overview of a node that sees two models, one peer of each, and a peer claiming
    a model name with markup in it (the page must show it as text)."""

    def overview(self) -> dict:
        fp_a, fp_b = "aa" * 16, "bb" * 16
        peer = {"addrs": [], "up": True, "rtt_ms": 1.0, "queue_depth": 0, "active": 0,
                "cached_blocks": 0, "digest_age_s": None, "trust": None}
        return {
            "generated_at": 1.7e9,
            "node": {"peer_id": ME.peer_id_b58, "model": fp_a[:16], "model_name": "model-a",
                     "models": [
                         {"name": "model-a", "fingerprint": fp_a, "nodes": 2, "local": True},
                         {"name": "model-b", "fingerprint": fp_b, "nodes": 1, "local": False}]},
            "peers": [{**peer, "peer_id": "12D3KooWpeerOfA", "model": "model-a"},
                      {**peer, "peer_id": "12D3KooWpeerOfB", "model": "model-b"},
                      {**peer, "peer_id": "12D3KooWliar", "model": "<img src=x onerror=1>"}],
            "namespaces": [], "cache": {}, "recent": []}


def test_the_dashboard_shows_the_mesh_models_and_each_peers_model_in_a_browser():
    """The page's JavaScript in headless Chromium against the stand-in overview."""
    from _browser import browser

    with gateway(MeshOpsBackend()) as url:
        done = browser(url + "/dashboard", "--dump-dom", budget_ms=3000)
    dom = done.stdout
    assert 'data-loaded="1"' in dom, (done.stderr[-3000:], dom[-3000:])
    assert f'data-model="{"aa" * 16}" data-nodes="2"' in dom
    assert f'data-model="{"bb" * 16}" data-nodes="1"' in dom
    assert "2 models, 3 nodes" in dom
    assert "model-a (aaaaaaaaaaaaaaaa)" in dom  # this node's model in its facts
    assert '<span class="small here"> this node\'s</span>' in dom
    peers = dom.split('id="peers-body"')[1].split("</tbody>")[0]
    assert peers.count('<td class="peer-model">model-a</td>') == 1
    assert peers.count('<td class="peer-model">model-b</td>') == 1
    assert "&lt;img src=x onerror=1&gt;" in peers and "<img" not in dom  # text, not markup
