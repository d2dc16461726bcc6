"""Test helper: a prefixmesh client that runs *inside* a NAT lab namespace (the test
process cannot reach the lab's addresses) and is driven over stdin/stdout, one JSON
command per line, one JSON answer per line:

    {"do": "ask", "addr": A, "messages": [[role, text], ...], "max_tokens": N, ...}
    {"do": "peers", "addr": A}

Started as ``ip netns exec NS python tests/nat/_lab_client.py``; not a test module.
"""

from __future__ import annotations

import json
import sys

import trio

from prefixmesh.node.client import Client
from prefixmesh.overlay.core.identity import peer_id_to_b58


def _b58(p: bytes) -> str:
    return peer_id_to_b58(p) if p else ""


async def _do(cmd: dict) -> dict:
    async with Client.connect(cmd["addr"]) as c:
        if cmd["do"] == "peers":
            r = await c.peers()
            return {"stats": dict(r.stats), "addrs": list(r.addrs),
                    "peers": [{"peer": _b58(p.peer), "up": p.up, "connected": p.connected,
                               "n_hashes": p.n_hashes, "addrs": list(p.addrs),
                               "active": p.active, "queue_depth": p.queue_depth}
                              for p in r.peers]}
        kw = {k: cmd[k] for k in ("max_tokens", "hop_budget", "deadline_s") if k in cmd}
        ans = await c.ask([tuple(m) for m in cmd["messages"]], **kw)
        f = ans.final
        return {"text": ans.text, "ttft_s": ans.ttft_s, "serving": _b58(f.serving),
                "entry": _b58(f.entry), "prompt_tokens": f.prompt_tokens,
                "cached_tokens": f.cached_tokens, "ttft_ms": f.ttft_ms,
                "hops": [{"peer": _b58(h.peer), "action": h.action, "reason": h.reason,
                          "next": _b58(h.next_peer), "ttft_ms": h.ttft_ms}
                         for h in f.hops]}


def main() -> None:
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            out = trio.run(_timed, cmd)
            out["ok"] = True
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            if isinstance(exc, KeyboardInterrupt):
                raise
            out = {"ok": False, "err": f"{type(exc).__name__}: {str(exc)[:300]}"}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


async def _timed(cmd: dict) -> dict:
    with trio.fail_after(cmd.get("timeout", 60)):
        return await _do(cmd)


if __name__ == "__main__":
    main()
