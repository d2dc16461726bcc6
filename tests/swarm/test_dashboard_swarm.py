"""Metrics, dashboard and ``prefixmesh status`` on real node processes (3 nodes, the real
default model, real libp2p): A and B run the HTTP gateway, C runs with the gateway off and
``[metrics] listen`` instead.

* ``/metrics`` after a few requests, parsed with ``prometheus_client.parser``: hits <=
  queries, requests = answers + errors, peers and engine gauges present.
* The dashboard in headless Chromium (Debian package ``chromium``; ``make test`` installs
  it): the DOM after the page's JavaScript ran shows both peers and a route trace, and a
  screenshot is taken (``PREFIXMESH_UPDATE_DOCS=1`` copies it to docs/dashboard.png; a
  normal run leaves the tree clean).
* ``prefixmesh status --peer`` prints the same facts in the terminal.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import _forkserver
import httpx
import pytest
from _browser import browser
from _swarm import NodeProc, Swarm, free_port, peers, wait_until  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SHARED = (
    "You are the reference desk of a small observatory. Answer in one short sentence. "
    "The observatory lends telescopes, star charts, spectroscopes and filters, and runs "
    "public nights on Fridays when the sky is clear. "
) * 6
KEY = "operator-key-for-the-dashboard-test"


class OpsNode:
    """A node process with the gateway ([http]) or only the operator endpoints ([metrics])."""

    def __init__(self, swarm: Swarm, name: str, *, gateway: bool, **kwargs):
        self.proc: NodeProc = swarm.add(name, **self._prepare(swarm, name, gateway, kwargs))

    def _prepare(self, swarm: Swarm, name: str, gateway: bool, kwargs: dict,
                 spot_checks: bool = False) -> dict:
        """Write the node's config; returns the ``Swarm.add`` keyword arguments."""
        self.port = free_port()
        cfg = swarm.root / f"{name}.toml"
        section = "http" if gateway else "metrics"
        cfg.write_text(f'[{section}]\nlisten = "127.0.0.1:{self.port}"\n'
                       + (f'api_key = "{KEY}"\n' if gateway else "")
                       + ("[routing]\nspot_check_fraction = 1.0\n" if spot_checks else "")
                       + '[tenants.public]\nvisibility = "public"\n')
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers = {"authorization": f"Bearer {KEY}"} if gateway else {}
        return {"extra": ["--config", str(cfg)], "n_ctx": 2048, **kwargs}

    @classmethod
    def add_many(cls, swarm: Swarm, specs: list[tuple[str, bool, bool]],
                 **kwargs) -> list[OpsNode]:
        """``(name, gateway, spot_checks)`` nodes started together (``Swarm.add_many``)."""
        nodes = [cls.__new__(cls) for _ in specs]
        prepared = [(name, node._prepare(swarm, name, gateway, dict(kwargs), spot))
                    for node, (name, gateway, spot) in zip(nodes, specs, strict=True)]
        for node, proc in zip(nodes, swarm.add_many(prepared), strict=True):
            node.proc = proc
        return nodes

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers, timeout=30)

    def chat(self, question: str, system: str = SHARED) -> dict:
        r = httpx.post(self.url + "/v1/chat/completions", headers=self.headers, timeout=120,
                       json={"model": "prefixmesh", "max_tokens": 4, "temperature": 0,
                             "messages": [{"role": "system", "content": system},
                                          {"role": "user", "content": question}]})
        assert r.status_code == 200, r.text
        return r.json()

    def metrics(self) -> dict[str, list]:
        r = self.get("/metrics")
        assert r.status_code == 200, r.text
        return {f.name: f.samples for f in text_string_to_metric_families(r.text)}


def _sum(fams: dict, name: str, **labels) -> float:
    """Sum of the samples named ``name`` (or ``name_total``) with these labels."""
    return sum(s.value for samples in fams.values() for s in samples
               if s.name in (name, name + "_total")
               if all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    root = tmp_path_factory.mktemp("dashswarm")
    with Swarm(root) as s:
        a = OpsNode(s, "A", gateway=True)
        # B re-executes every answer it gets from a peer (spot checks on the dashboard)
        b, c = OpsNode.add_many(s, [("B", True, True), ("C", False, False)],
                                bootstrap=[a.proc.addr])
        wait_until(lambda: all(sum(p.up for p in peers(n.proc.addr).peers) == 2
                               for n in (a, b, c)),
                   timeout_s=60, what="every node to see the two others up")
        # a few requests: two at A (the second reuses the first's prefix), then one at B
        # once B has heard of A's cached prefix (it may forward it to A)
        first = a.chat("When are public nights?")
        a.chat("What can I borrow?")
        blocks = first["usage"]["prompt_tokens"] // 16 - 1
        wait_until(lambda: {p.peer: p.n_hashes for p in peers(b.proc.addr).peers}
                   .get(a.proc.peer_id, 0) >= blocks, timeout_s=30, what="B to learn A's prefix")
        b.chat("Do you lend filters?")
        b.chat("Say hello.", system="You are a terse greeter.")  # served at B: its own cache
        yield {"A": a, "B": b, "C": c}, s


def test_metrics_after_requests_are_consistent(swarm):
    ns, s = swarm
    a, b = ns["A"], ns["B"]
    for node in (a, b):
        fams = node.metrics()
        requests = _sum(fams, "prefixmesh:requests")
        answered = _sum(fams, "prefixmesh:request_success")
        errors = _sum(fams, "prefixmesh:request_errors")
        assert requests == answered + errors, fams
        queries = _sum(fams, "prefixmesh:prefix_cache_queries")
        hits = _sum(fams, "prefixmesh:prefix_cache_hits")
        assert 0 <= hits <= queries
        assert _sum(fams, "prefixmesh:mesh_prefix_cache_hits") <= _sum(
            fams, "prefixmesh:mesh_prefix_cache_queries")
        assert _sum(fams, "prefixmesh:peers_up") == 2
        assert len([x for x in fams["prefixmesh:peer_up"] if x.value == 1]) == 2
        assert 0 <= _sum(fams, "prefixmesh:kv_cache_usage_perc") <= 1
        assert "prefixmesh:num_requests_running" in fams
        assert "prefixmesh:num_requests_waiting" in fams
        assert _sum(fams, "prefixmesh:digest_bytes", direction="in") > 0
        assert "prefixmesh:rejected_frames" in fams
    fa = a.metrics()
    # A answered its two client requests (entries), and served at least those itself
    assert _sum(fa, "prefixmesh:requests", entry="true", outcome="answered") == 2, s.logs()
    assert _sum(fa, "prefixmesh:time_to_first_token_seconds_count") == 2
    assert _sum(fa, "prefixmesh:e2e_request_latency_seconds_count") == 2
    assert _sum(fa, "prefixmesh:prefix_cache_queries") >= 2 * 200
    # the second request at A reused the first one's prefix
    assert _sum(fa, "prefixmesh:prefix_cache_hits") > 0
    fb = b.metrics()
    assert _sum(fb, "prefixmesh:requests", entry="true") == 2
    # a bad request is an error at the gateway, not a request of the mesh: counts unchanged
    bad = httpx.post(b.url + "/v1/chat/completions", headers=b.headers, content=b"{oops")
    assert bad.status_code == 400
    assert _sum(b.metrics(), "prefixmesh:requests") == _sum(fb, "prefixmesh:requests")


def test_operator_endpoints_need_the_key_on_a_keyed_node(swarm):
    a = swarm[0]["A"]
    assert httpx.get(a.url + "/metrics").status_code == 401
    assert httpx.get(a.url + "/prefixmesh/overview").status_code == 401
    assert httpx.get(a.url + "/dashboard").status_code == 200  # the page itself holds no data


def test_metrics_listener_with_the_gateway_off(swarm):
    c = swarm[0]["C"]
    fams = c.metrics()
    assert _sum(fams, "prefixmesh:peers_up") == 2
    assert c.get("/v1/models").status_code == 404
    ov = c.get("/prefixmesh/overview").json()
    assert ov["node"]["peer_id"] == c.proc.peer_b58 and ov["gateway"] is None


def test_overview_lists_peers_prefixes_and_routes(swarm):
    ns, _ = swarm
    a, b, c = ns["A"], ns["B"], ns["C"]
    ov = a.get("/prefixmesh/overview").json()
    assert {p["peer_id"] for p in ov["peers"]} == {b.proc.peer_b58, c.proc.peer_b58}
    assert all(p["up"] and p["rtt_ms"] is not None for p in ov["peers"])
    public = next(n for n in ov["namespaces"] if n["name"] == "public")
    assert public["prefixes"] >= 1 and public["tokens"] > 0
    assert public["ram_bytes"] + public["disk_bytes"] > 0
    # A served its two requests itself; the second reused the first one's prefix
    assert public["served_requests"] >= 2 and 0 < public["cached_tokens"] <= public[
        "prompt_tokens"]
    assert all(set(e) == {"tokens", "bytes", "tier"} for e in public["largest"])
    assert "SHARED" not in str(ov) and "observatory" not in str(ov)  # sizes, never contents
    assert len(ov["recent"]) >= 2
    assert all(r["route"] and r["error"] == "" for r in ov["recent"][:2])


def test_dashboard_in_headless_chromium_shows_peers_and_a_route(swarm, tmp_path):
    ns, s = swarm
    a, b, c = ns["A"], ns["B"], ns["C"]
    page = f"{b.url}/dashboard#key={KEY}"

    def checked():  # every answer B took from a peer re-executed (a verdict, or not run)
        ov = b.get("/prefixmesh/overview").json()
        n = ov["spot_checks"]["counts"]
        return n["checks"] + n["failed"] + n["dropped"] >= ov["node"]["infer"]["forwarded"]

    wait_until(checked, timeout_s=120, what="B's spot checks of forwarded answers")
    done = browser(page, "--dump-dom")
    dom = done.stdout
    assert 'data-loaded="1"' in dom, (done.stderr[-3000:], dom[-3000:])
    for other in (a, c):
        assert f'data-peer="{other.proc.peer_b58}"' in dom
    assert dom.count('class="request"') >= 1
    assert '<li class="hop">' in dom  # a route trace, one line per hop
    assert b.proc.peer_b58 in dom  # this node's id in the header
    # the mesh's models (GET /v1/models' data): one model, served by the three nodes; and
    # each peer's model in the peers table
    fp = next(m for m in b.get("/v1/models").json()["data"] if m["id"] != "prefixmesh")
    assert f'data-model="{fp["prefixmesh"]["fingerprint"]}" data-nodes="3"' in dom
    assert dom.count('<td class="peer-model">SmolLM2-135M-Instruct.Q4_1</td>') == 2
    assert "observatory" not in dom  # prompt text never reaches the page
    # B's spot checks: the section is shown, and each answer B took from a peer (A holds
    # the shared prefix) is re-executed here and listed with its verdict
    assert '<section id="spot">' in dom and "re-executed here" in dom
    spot = b.get("/prefixmesh/overview").json()["spot_checks"]
    assert dom.count('class="spot"') == len(spot["last"])
    assert all(e["kind"] == "match" for e in spot["last"])  # A is honest
    fams = b.metrics()
    assert _sum(fams, "prefixmesh:spot_checks", outcome="match") == spot["counts"]["matches"]
    assert _sum(fams, "prefixmesh:spot_checks") == spot["counts"]["checks"] + \
        spot["counts"]["failed"] + spot["counts"]["dropped"]
    assert "prefixmesh:spot_checks" not in a.metrics()  # off on A
    assert '<section id="spot" hidden' in browser(f"{a.url}/dashboard#key={KEY}",
                                                 "--dump-dom").stdout  # off on A
    shot = tmp_path / "dashboard.png"
    done = browser(page, f"--screenshot={shot}")
    assert shot.exists() and shot.stat().st_size > 10_000, done.stderr[-3000:]
    if os.environ.get("PREFIXMESH_UPDATE_DOCS") == "1":  # refresh docs/dashboard.png on demand
        shutil.copyfile(shot, ROOT / "docs" / "dashboard.png")


def test_status_cli_prints_the_same_facts(swarm):
    ns, _ = swarm
    a, b, c = ns["A"], ns["B"], ns["C"]
    run = [sys.executable, "-m", "prefixmesh", "status", "--peer", a.url, "--api-key", KEY]
    # the status processes are forked from the fork server where they can be (same main)
    out = _forkserver.run(run, timeout=60, env=dict(os.environ, COLUMNS="120", LINES="40"))
    assert out.returncode == 0, out.stderr
    assert a.proc.peer_b58 in out.stdout
    assert b.proc.peer_b58[-8:] in out.stdout and c.proc.peer_b58[-8:] in out.stdout
    assert "peers (2 up of 2)" in out.stdout
    assert "public" in out.stdout and "last requests" in out.stdout
    # --watch redraws (twice here), on the node without a gateway, no key needed there
    out = _forkserver.run([sys.executable, "-m", "prefixmesh", "status", "--peer",
                           c.url.removeprefix("http://"), "--watch", "--interval", "0.2",
                           "--rounds", "2"], timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("\x1b[2J") == 2 and c.proc.peer_b58 in out.stdout
    # wrong key: one line, exit 1
    out = _forkserver.run([*run[:-1], "wrong"], timeout=60)
    assert out.returncode == 1 and "HTTP 401" in out.stderr and len(out.stderr.splitlines()) == 1
