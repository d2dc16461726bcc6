"""Logs for people, from real node processes (real libp2p, the real default model):
one line per record with time and level, py-libp2p's noise about a bootstrap peer that is
down kept out of the INFO log (one WARNING of ours instead), and ``--log-format json``
lines that all parse."""

from __future__ import annotations

import json
import re
import socket
import time

import pytest
from _swarm import Swarm, ask, wait_until  # noqa: E402

pytestmark = pytest.mark.slow  # real node processes and the real model

_TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")


def _dead_bootstrap() -> str:
    with socket.socket() as s:  # a port nobody listens on (connections are refused)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"/ip4/127.0.0.1/tcp/{port}/p2p/12D3KooWDLed76Dxeu3iEDzb8F13U3vaD24fqzNTnHA8cq9ej43i"


def test_json_log_format_every_line_parses(tmp_path):
    with Swarm(tmp_path) as swarm:
        node = swarm.add("a", extra=["--log-format", "json"])
        answer = ask(node.addr, [("user", "Say hello.")], max_tokens=4)
        assert answer.text
        node.terminate()
        lines = [ln for ln in node.log_tail(200000).splitlines() if ln.strip()]
    docs = [json.loads(ln) for ln in lines]  # every line is one JSON object
    assert all({"ts", "level", "logger", "msg"} <= d.keys() for d in docs)
    assert any(d["logger"] == "prefixmesh.node" and "shutting down" in d["msg"] for d in docs)
    # the start's milestones: the engine loaded (it answers), then the overlay joined
    msgs = [d["msg"] for d in docs if d["logger"] == "prefixmesh.node"]
    loaded = next(i for i, m in enumerate(msgs) if m.startswith("loading the model and "
                                                                  "checking the KV cache: done"))
    joined = next(i for i, m in enumerate(msgs) if m.startswith("joined the overlay as "))
    assert loaded < joined and node.peer_b58 in msgs[joined], msgs
    # the per-request line carries its facts as fields
    (req,) = [d for d in docs if d["logger"] == "prefixmesh.requests"]
    assert req["level"] == "info" and req["entry"] is True and req["action"] == "serve"
    assert req["completion_tokens"] == answer.final.completion_tokens
    assert req["prompt_tokens"] > 0 and req["ttft_s"] > 0 and req["total_s"] >= req["ttft_s"]
    assert req["served_by"] == node.peer_b58


def test_down_bootstrap_peer_is_one_warning_and_one_info_line_per_request(tmp_path):
    """Two facets of one two-node swarm (each node start costs seconds): B, bootstrapped
    to A and to a peer that is down, logs one WARNING about it, not py-libp2p's flood,
    every line with time and level; and one INFO line per request, at the entry and (as
    "from peer") at a serving node it forwarded to."""
    with Swarm(tmp_path) as swarm:
        a = swarm.add("a")
        b = swarm.add("b", bootstrap=[a.addr, _dead_bootstrap()], dht=True)  # -v: INFO
        t0 = time.monotonic()
        wait_until(lambda: "not reachable" in b.log_tail(50000), 30,
                   what="the bootstrap warning")
        for _ in range(2):
            ask(b.addr, [("user", "Name a colour.")], max_tokens=3)
        # several retries (backoff 0.5, 1, 2, 4 s) and DHT rounds
        time.sleep(max(0.0, 8.0 - (time.monotonic() - t0)))
        b.terminate()
        a.terminate()
        all_b = [ln for ln in b.log_tail(200000).splitlines() if ln.strip()]
        lines_b = [ln for ln in all_b if "prefixmesh.requests" in ln]
        lines_a = [ln for ln in a.log_tail(200000).splitlines() if "prefixmesh.requests" in ln]
    odd = [ln for ln in all_b if not _TEXT_LINE.match(ln)]
    assert not odd, f"lines without time and level: {odd[:5]}"
    assert not [ln for ln in all_b if "Failed to open" in ln], all_b
    assert not [ln for ln in all_b if " libp2p" in ln], all_b
    warnings = [ln for ln in all_b if "bootstrap peer" in ln and "not reachable" in ln]
    assert len(warnings) == 1 and " WARNING " in warnings[0], warnings
    assert len(lines_b) == 2, lines_b  # the entry node: one line per request
    for line in lines_b:
        assert " INFO prefixmesh.requests: request " in line and " entry: " in line, line
        for part in ("prompt tokens", "TTFT ", "total ", "served by "):
            assert part in line, (part, line)
    # a request the entry forwarded is logged at the serving node too, as "from peer"
    assert all(" from peer: " in ln for ln in lines_a), lines_a
