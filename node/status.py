"""One snapshot of a node for people: the dashboard's JSON and ``prefixmesh status``.

:func:`overview` reads a running node (the daemon's ``Node``) and its
:class:`~prefixmesh.node.metrics.NodeMetrics` into plain JSON-able data: this node, its
peers (up, RTT, load, trust, digest), its cached prefixes by namespace (counts, token
lengths, bytes, tiers: never token ids or text), the KV store's hit counters and the last
requests' route traces. The gateway serves it at ``GET /prefixmesh/overview`` (same
listener as ``/metrics``; the dashboard polls it), and ``prefixmesh status --peer URL``
fetches it (:func:`fetch_overview`) and prints it as one terminal screen
(:func:`render_text`).

Why HTTP and not a libp2p protocol for ``status``: the browser dashboard needs HTTP anyway,
so one JSON document, one auth rule and one code path serve both; a node with its gateway
off still serves it on ``[metrics] listen``.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from typing import Any

__all__ = ["overview", "render_text", "fetch_overview", "cli_status", "status_url",
           "StatusError", "PREFIXES_LISTED", "MAX_PEERS", "SPOT_CHECKS_LISTED"]

#: per namespace, the largest cached prefixes listed one by one
PREFIXES_LISTED = 20
#: peers listed (the rest are counted)
MAX_PEERS = 64


class StatusError(Exception):
    """``prefixmesh status`` could not get a node's overview (message says why)."""


def _b58(peer: bytes) -> str:
    from prefixmesh.overlay.core.identity import peer_id_to_b58

    try:
        return peer_id_to_b58(peer) if peer else ""
    except Exception:  # a malformed id from a peer: show it raw
        return bytes(peer).hex()


def _num(x: Any, nd: int = 3) -> float | None:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return round(x, nd) if math.isfinite(x) else None


def overview(node: Any, metrics: Any = None, *, now: float | None = None) -> dict[str, Any]:
    """A JSON-able snapshot of ``node`` (read on the trio thread, never blocks long)."""
    now = time.time() if now is None else now
    out: dict[str, Any] = {"generated_at": now, "node": _self(node, metrics, now)}
    out["peers"] = _peers(node, now)
    out["namespaces"], out["cache"] = _cache(node, metrics)
    out["recent"] = _recent(metrics)
    out["spot_checks"] = _spot_checks(node)
    return out


def _self(node, metrics, now: float) -> dict[str, Any]:
    me: dict[str, Any] = {
        "peer_id": node.identity.peer_id_b58,
        "addrs": list(node.full_addrs()) if hasattr(node, "full_addrs") else [],
        "model": bytes(getattr(node, "model_fp", b"")).hex()[:16],
        "model_name": getattr(node, "model_name", ""),
        # the mesh's models now (core/models.catalog): name, fingerprint, nodes serving it
        "models": [{"name": m.name, "fingerprint": m.fp_hex, "nodes": m.nodes, "local": m.local}
                   for m in (node.models() if hasattr(node, "models") else ())],
        "policy": getattr(getattr(node, "policy", None), "name", ""),
    }
    if metrics is not None:
        me["uptime_s"] = round(now - metrics.started_at, 1)
        me["requests_in_flight"] = metrics.in_flight
    try:
        load = node.backend.load_figures()
        me["engine"] = {
            "active": load.active, "queue_depth": load.queue_depth,
            "kv_used_bytes": load.kv_used_bytes, "kv_capacity_bytes": load.kv_capacity_bytes,
            "prefill_tps": _num(load.prefill_tps, 1) if load.prefill_measured else None,
            "decode_tps": _num(load.decode_tps, 1),
            "batch_mode": "throughput" if getattr(node.backend, "batched", False)
            else "deterministic",
        }
        batching = getattr(getattr(node.backend, "engine", None), "batch_counters", None)
        if me["engine"]["batch_mode"] == "throughput" and batching is not None:
            steps = batching["steps"]
            me["engine"]["batch_steps"] = steps
            me["engine"]["sequences_per_step"] = _num(batching["sequences"] / steps, 2) \
                if steps else None
    except Exception:  # engine not loaded yet or closing
        me["engine"] = None
    if getattr(node, "reachability", None) is not None:  # issue 16
        from prefixmesh.overlay.dialback import reachability_report

        me["reachability"] = reachability_report(node)
    infer = getattr(node, "infer", None)
    if infer is not None:
        keep = ("requests", "served_local", "forwarded", "fallbacks", "errors", "rate_limited")
        me["infer"] = {k: int(infer.stats.get(k, 0)) for k in keep}
    return me


#: spot-check verdicts listed, newest first
SPOT_CHECKS_LISTED = 10


def _spot_checks(node) -> dict[str, Any] | None:
    """Counters and the last verdicts of spot checks (None when they are off). The tokens
    or text compared are left out: like the rest of the overview, no request content."""
    infer = getattr(node, "infer", None)
    if infer is None or getattr(infer, "spot_checker", None) is None:
        return None
    counts = {k.removeprefix("spot_"): int(v) for k, v in infer.stats.items()
              if k.startswith("spot_")}
    keep = ("request_id", "peer", "serving", "kind", "unit", "first_mismatch",
            "trust_before", "trust_after")
    last = [{k: e.get(k) for k in keep} for e in reversed(infer.spot_log)]
    return {"fraction": infer.spot_checker.fraction, "counts": counts,
            "last": last[:SPOT_CHECKS_LISTED]}


def _peers(node, now: float) -> list[dict[str, Any]]:
    hb = getattr(node, "heartbeat", None)
    health = dict(hb.health) if hb is not None else {}
    index = getattr(node, "index", None)
    directory = getattr(node, "directory", None)
    known = set(health)
    if directory is not None:
        known |= set(directory.peers)
    if index is not None:
        known |= set(index.peers())
    known.discard(node.identity.peer_id)
    trust = getattr(getattr(node, "infer", None), "trust", None)
    digest = getattr(node, "exchange", None)
    mono = time.monotonic()
    rows = []
    for peer in sorted(known)[:MAX_PEERS]:
        h = health.get(peer)
        est = index.estimate(peer) if index is not None else None
        heard = digest.last_heard.get(peer) if digest is not None else None
        addrs = (directory.addrs_of(peer) if directory is not None else []) or (
            list(est.addrs) if est else [])
        row: dict[str, Any] = {
            "peer_id": _b58(peer),
            "addrs": [str(a)[:200] for a in addrs[:4]],
            "up": bool(h and h.up),
            "rtt_ms": _num(h.rtt_s * 1000.0, 2) if h and h.rtt_s is not None else None,
            "queue_depth": h.queue_depth if h else (est.load.queue_depth if est else 0),
            "active": h.active if h else (est.load.active if est else 0),
            "cached_blocks": est.n_hashes if est else 0,
            "kv_used_bytes": est.kv_used_bytes if est else None,
            "digest_age_s": _num(max(0.0, now - heard), 1) if heard else None,
            "trust": _num(trust.trust(peer, mono)) if trust is not None else None,
            "model": (getattr(h, "model_name", "") or getattr(h, "model", b"").hex()[:16]
                      or None) if h else None,
        }
        rows.append(row)
    return rows


def _store_prefixes(store) -> list[tuple[bytes, int, int, str]]:
    """(ns_id, tokens, bytes, tier) per cached prefix. ``KVStore.prefixes()`` has no sizes,
    so read the tiers' entries under the store's own lock; on a store without them, sizes
    are unknown (0)."""
    try:
        inv = {v: k for k, v in store._ns_token.items()}
        with store._lock:
            seen: dict[tuple[int, ...], tuple[int, str]] = {}
            for entry in store._disk.entries():
                seen[entry.tokens] = (entry.size_bytes, "disk")
            for entry in store._ram.entries():
                seen[entry.tokens] = (entry.size_bytes, "ram")
        return [(inv.get(k[0], b""), len(k) - 1, size, tier) for k, (size, tier) in seen.items()]
    except AttributeError:
        return [(ns, len(tokens), 0, tier) for ns, tokens, tier in store.prefixes()]


def _cache(node, metrics=None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    store = getattr(getattr(getattr(node, "backend", None), "engine", None), "store", None)
    tenants = getattr(node, "tenants", None)
    by_ns: dict[bytes, dict[str, Any]] = {}
    if tenants is not None:
        for t in tenants:
            by_ns[t.ns_id] = {"name": t.name, "ns_id": t.ns_id.hex(), "visibility": t.visibility,
                              "prefixes": 0, "tokens": 0, "ram_bytes": 0, "disk_bytes": 0,
                              "largest": []}
    cache: dict[str, Any] = {}
    served = getattr(metrics, "by_ns", {}) if metrics is not None else {}
    for ns, d in by_ns.items():  # requests served here from this namespace, and their hits
        n, prompt, cached = served.get(ns, (0, 0, 0))
        d.update(served_requests=n, prompt_tokens=prompt, cached_tokens=cached)
    if store is None:
        return list(by_ns.values()), cache
    rows = _store_prefixes(store)
    for ns, n_tokens, size, tier in rows:
        d = by_ns.setdefault(ns, {"name": "?", "ns_id": ns.hex(), "visibility": "?",
                                  "prefixes": 0, "tokens": 0, "ram_bytes": 0, "disk_bytes": 0,
                                  "largest": [], "served_requests": 0, "prompt_tokens": 0,
                                  "cached_tokens": 0})
        d["prefixes"] += 1
        d["tokens"] += n_tokens
        d[f"{tier}_bytes"] += size
        d["largest"].append({"tokens": n_tokens, "bytes": size, "tier": tier})
    for d in by_ns.values():
        d["largest"] = sorted(d["largest"], key=lambda e: -e["tokens"])[:PREFIXES_LISTED]
    st = store.stats
    cache = {"hits_ram": st.hits_ram, "hits_disk": st.hits_disk, "misses": st.misses,
             "ram_bytes": st.ram_bytes, "ram_budget_bytes": st.ram_budget_bytes,
             "disk_bytes": st.disk_bytes, "disk_budget_bytes": st.disk_budget_bytes}
    return list(by_ns.values()), cache


def _recent(metrics) -> list[dict[str, Any]]:
    if metrics is None:
        return []
    out = []
    for at, ev in reversed(metrics.recent):  # newest first
        out.append({
            "at": round(at, 3), "id": ev.request_id.hex()[:12], "entry": ev.entry,
            "action": ev.action, "reason": ev.reason[:300], "served_by": _b58(ev.served_by),
            "route": [str(r)[:300] for r in ev.route[:8]],
            "prompt_tokens": ev.prompt_tokens, "cached_tokens": ev.cached_tokens,
            "completion_tokens": ev.completion_tokens,
            "ttft_ms": _num(ev.ttft_s * 1000.0, 1), "total_ms": _num(ev.total_s * 1000.0, 1),
            "error": ev.error,
        })
    return out


# --- the terminal view -------------------------------------------------------------------


def _size(n: Any) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _short(peer_id: str) -> str:
    return peer_id[-8:] if peer_id else "-"


def render_text(ov: dict[str, Any], *, width: int = 100, height: int = 40) -> str:
    """The overview as one terminal screen (at most ``height`` lines of ``width`` chars)."""
    me = ov.get("node", {})
    lines = [f"node {me.get('peer_id', '?')}  model {me.get('model', '?')}  "
             f"policy {me.get('policy', '?')}  up {me.get('uptime_s', 0):.0f} s"]
    if me.get("models"):
        lines.append("models: " + ", ".join(
            f"{m.get('name', '?')} ({m.get('nodes', 0)} node{'s' if m.get('nodes') != 1 else ''}"
            f"{', here' if m.get('local') else ''})" for m in me["models"][:8]))
    reach = me.get("reachability") or {}
    if reach:
        lines.append(f"reachability: {reach.get('line', '?')}"
                     + (f"  (NAT {reach['nat']})" if reach.get("nat", "unknown") != "unknown" else ""))
    eng = me.get("engine") or {}
    if eng:
        cap = eng.get("kv_capacity_bytes") or 0
        used = eng.get("kv_used_bytes") or 0
        pct = f"{100 * used / cap:.0f}%" if cap else "-"
        lines.append(f"engine: {eng.get('active', 0)} running, {eng.get('queue_depth', 0)} "
                     f"waiting; KV {_size(used)} / {_size(cap)} ({pct}); prefill "
                     f"{eng.get('prefill_tps') or '-'} tok/s, decode {eng.get('decode_tps')} tok/s"
                     + (f"; batched, {eng.get('sequences_per_step') or '-'} sequences a step"
                        if eng.get("batch_mode") == "throughput" else ""))
    inf = me.get("infer") or {}
    if inf:
        lines.append(f"requests {inf.get('requests', 0)}: served here "
                     f"{inf.get('served_local', 0)}, forwarded {inf.get('forwarded', 0)}, "
                     f"fallbacks {inf.get('fallbacks', 0)}, errors {inf.get('errors', 0)}; "
                     f"in flight {me.get('requests_in_flight', 0)}")
    peers = ov.get("peers", [])
    lines.append("")
    lines.append(f"peers ({sum(p['up'] for p in peers)} up of {len(peers)})")
    lines.append(f"  {'peer':<10} {'up':<4} {'rtt ms':>8} {'queue':>5} {'run':>4} {'trust':>6} "
                 f"{'blocks':>7} {'digest age':>10}")
    for p in peers[:10]:
        trust = "-" if p.get("trust") is None else f"{p['trust']:.2f}"
        age = "-" if p.get("digest_age_s") is None else f"{p['digest_age_s']:.0f} s"
        rtt = "-" if p.get("rtt_ms") is None else f"{p['rtt_ms']:.1f}"
        lines.append(f"  {_short(p['peer_id']):<10} {'yes' if p['up'] else 'no':<4} {rtt:>8} "
                     f"{p['queue_depth']:>5} {p['active']:>4} {trust:>6} "
                     f"{p['cached_blocks']:>7} {age:>10}")
    if len(peers) > 10:
        lines.append(f"  ... {len(peers) - 10} more")
    lines.append("")
    c = ov.get("cache") or {}
    lines.append("cache by namespace" + (
        f" (store hits: {c.get('hits_ram', 0)} RAM, {c.get('hits_disk', 0)} disk, "
        f"{c.get('misses', 0)} misses)" if c else ""))
    for ns in ov.get("namespaces", [])[:6]:
        lines.append(f"  {ns['name']:<12} {ns['prefixes']:>4} prefixes {ns['tokens']:>7} tokens "
                     f"RAM {_size(ns['ram_bytes']):>9} disk {_size(ns['disk_bytes']):>9}  "
                     f"hits {ns.get('cached_tokens', 0)}/{ns.get('prompt_tokens', 0)} tok "
                     f"in {ns.get('served_requests', 0)} req")
    spot = ov.get("spot_checks")
    if spot:
        n = spot["counts"]
        lines.append(f"spot checks ({spot['fraction']:.0%} of forwarded answers): "
                     f"{n.get('checks', 0)} run, {n.get('matches', 0)} match, "
                     f"{n.get('drifts', 0)} drift, {n.get('mismatches', 0)} mismatch, "
                     f"{n.get('failed', 0) + n.get('dropped', 0)} not run")
        for e in [e for e in spot["last"] if e["kind"] == "mismatch"][:3]:
            trust = "" if e["trust_after"] is None else \
                f", trust {e['trust_before']:.2f} -> {e['trust_after']:.2f}"
            lines.append(f"  MISMATCH {e['request_id'][:8]} peer {_short(e['peer'])} at "
                         f"{e['unit']} {e['first_mismatch']}{trust}")
    lines.append("")
    recent = ov.get("recent", [])
    lines.append(f"last requests ({len(recent)})")
    for r in recent[: max(3, height - len(lines) - 1)]:
        who = "client" if r["entry"] else "peer"
        tail = f"error {r['error']}" if r["error"] else (
            f"served by {_short(r['served_by'])}, {r['cached_tokens']}/{r['prompt_tokens']} "
            f"cached, ttft {r['ttft_ms']} ms, total {r['total_ms']} ms")
        lines.append(f"  {r['id'][:8]} from {who}: {r['action']}; {tail}")
        for hop in r.get("route", [])[:3]:
            lines.append(f"      {hop}")
    return "\n".join(line[:width] for line in lines[:height])


# --- fetching ----------------------------------------------------------------------------


def status_url(peer: str) -> str:
    """``HOST:PORT`` or ``http://HOST:PORT[/]`` -> the overview URL."""
    base = peer.strip()
    if not base.startswith(("http://", "https://")):
        base = "http://" + base
    return base.rstrip("/") + "/prefixmesh/overview"


def fetch_overview(peer: str, *, api_key: str = "", timeout_s: float = 5.0) -> dict[str, Any]:
    req = urllib.request.Request(status_url(peer), headers={"Accept": "application/json"})
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 (http only)
            return json.loads(resp.read(4 << 20))
    except urllib.error.HTTPError as exc:
        try:
            msg = json.loads(exc.read(64 << 10))["error"]["message"]
        except Exception:
            msg = exc.reason
        raise StatusError(f"{status_url(peer)}: HTTP {exc.code}: {msg}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise StatusError(f"{status_url(peer)}: {reason}") from None


# --- the CLI ------------------------------------------------------------------------------


def cli_status(args: Any, *, out=None) -> int:
    """``prefixmesh status --peer URL [--watch] [--interval S] [--api-key KEY] [--json]``."""
    import os
    import shutil
    import sys

    out = out or sys.stdout
    key = getattr(args, "api_key", None) or os.environ.get("PREFIXMESH_API_KEY", "")
    interval = max(0.2, float(getattr(args, "interval", 2.0) or 2.0))
    watch = bool(getattr(args, "watch", False))
    rounds = getattr(args, "rounds", None)  # tests: stop --watch after that many screens
    n = 0
    try:
        while True:
            try:
                ov = fetch_overview(args.peer, api_key=key)
            except StatusError as exc:
                if not watch:
                    print(f"prefixmesh status: error: {exc}", file=sys.stderr)
                    return 1
                text = f"prefixmesh status: {exc} (retrying every {interval:g} s)"
            else:
                if getattr(args, "json", False):
                    text = json.dumps(ov, indent=2)
                else:
                    size = shutil.get_terminal_size((100, 40))
                    text = render_text(ov, width=size.columns, height=size.lines - 1)
            if watch:
                out.write("\x1b[H\x1b[2J")  # home + clear: one screen, redrawn in place
            out.write(text + "\n")
            out.flush()
            n += 1
            if not watch or (rounds is not None and n >= rounds):
                return 0
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
