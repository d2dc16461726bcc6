// prefixmesh node dashboard: polls /prefixmesh/overview and renders it.
// Every value from the node (and from its peers, e.g. addresses) goes into the page through
// textContent, never as HTML: a peer must not be able to inject markup.
"use strict";

const POLL_MS = 2000;
const KEY_ITEM = "prefixmesh-api-key";

function apiKey() {
  // #key=KEY in the URL (a fragment never reaches a server log), then this tab's storage
  const m = /(?:^|[#&])key=([^&]+)/.exec(location.hash);
  if (m) {
    sessionStorage.setItem(KEY_ITEM, decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname);
  }
  return sessionStorage.getItem(KEY_ITEM) || "";
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) {
    node.append(c instanceof Node ? c : document.createTextNode(c == null ? "-" : String(c)));
  }
  return node;
}

function size(n) {
  if (n == null) return "-";
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return i === 0 ? `${n} B` : `${n.toFixed(1)} ${units[i]}`;
}

function short(id) { return id ? id.slice(-8) : "-"; }
function fixed(x, d) { return x == null ? "-" : Number(x).toFixed(d); }

function renderSelf(me) {
  document.getElementById("node-id").textContent = me.peer_id;
  document.title = `prefixmesh ${short(me.peer_id)}`;
  const e = me.engine || {};
  const inf = me.infer || {};
  const facts = [
    ["peer id", me.peer_id], ["addresses", (me.addrs || []).join("  ")],
    ["model", me.model_name ? `${me.model_name} (${me.model})` : me.model],
    ["policy", me.policy],
    ["uptime", me.uptime_s == null ? "-" : `${Math.round(me.uptime_s)} s`],
    ["reachability", me.reachability ? me.reachability.line +
      (me.reachability.nat && me.reachability.nat !== "unknown" ? ` (NAT ${me.reachability.nat})` : "")
      : "-"],
    ["engine", `${e.active ?? 0} running, ${e.queue_depth ?? 0} waiting` +
      (e.batch_mode === "throughput"
        ? `; batched, ${e.sequences_per_step ?? "-"} sequences a step` : "")],
    ["rates", (e.prefill_tps == null ? "prefill not measured yet"
      : `prefill ${fixed(e.prefill_tps, 0)} tok/s`) + `, decode ${fixed(e.decode_tps, 0)} tok/s`],
    ["requests", `${inf.requests ?? 0} (served here ${inf.served_local ?? 0}, forwarded ` +
      `${inf.forwarded ?? 0}, fallbacks ${inf.fallbacks ?? 0}, errors ${inf.errors ?? 0}), ` +
      `in flight ${me.requests_in_flight ?? 0}`],
  ];
  const dl = document.getElementById("self-facts");
  dl.replaceChildren(...facts.flatMap(([k, v]) => [el("dt", {}, k),
    el("dd", { class: k === "peer id" || k === "addresses" ? "mono" : "" }, v)]));
  const cap = e.kv_capacity_bytes || 0;
  const used = e.kv_used_bytes || 0;
  document.getElementById("kv-bar").style.width = cap ? `${(100 * used / cap).toFixed(1)}%` : "0";
  document.getElementById("kv-text").textContent =
    `KV cache (RAM) ${size(used)} of ${size(cap)}`;
}

function renderModels(models) {
  // the mesh's models now, as GET /v1/models lists them: this node's first, then by nodes
  const total = models.reduce((n, m) => n + (m.nodes || 0), 0);
  document.getElementById("models-count").textContent =
    `${models.length} model${models.length === 1 ? "" : "s"}, ${total} node${total === 1 ? "" : "s"}`;
  document.getElementById("models-body").replaceChildren(...models.map((m) => el("tr",
    { class: "model", "data-model": m.fingerprint, "data-nodes": String(m.nodes) },
    el("td", {}, m.name, m.local ? el("span", { class: "small here" }, " this node's") : ""),
    el("td", { class: "mono", title: m.fingerprint }, (m.fingerprint || "").slice(0, 16)),
    el("td", { class: "num" }, m.nodes),
  )));
}

function renderPeers(peers) {
  const up = peers.filter((p) => p.up).length;
  document.getElementById("peers-count").textContent = `${up} up of ${peers.length}`;
  document.getElementById("peers-body").replaceChildren(...peers.map((p) => el("tr",
    { class: "peer", "data-peer": p.peer_id, title: (p.addrs || []).join("\n") },
    el("td", { class: "mono", title: p.peer_id }, `…${p.peer_id.slice(-12)}`),
    el("td", { class: p.up ? "up" : "down" }, p.up ? "up" : "down"),
    el("td", { class: "peer-model" }, p.model),
    el("td", { class: "num" }, fixed(p.rtt_ms, 1)),
    el("td", { class: "num" }, p.queue_depth),
    el("td", { class: "num" }, p.active),
    el("td", { class: "num" }, fixed(p.trust, 2)),
    el("td", { class: "num" }, p.cached_blocks),
    el("td", { class: "num" }, p.digest_age_s == null ? "-" : `${fixed(p.digest_age_s, 0)} s`),
  )));
}

function renderCache(namespaces, cache) {
  const c = cache || {};
  document.getElementById("cache-hits").textContent = cache && c.hits_ram != null
    ? `store hits: ${c.hits_ram} RAM, ${c.hits_disk} disk, ${c.misses} misses` : "";
  document.getElementById("ns-body").replaceChildren(...namespaces.map((ns) => {
    const most = Math.max(1, ...ns.largest.map((p) => p.tokens));
    const bars = el("td", {}, ...ns.largest.slice(0, 12).map((p) => {
      const bar = el("span",
        { class: "bar", title: `${p.tokens} tokens, ${size(p.bytes)}, ${p.tier}` });
      bar.style.width = `${Math.max(2, 60 * p.tokens / most)}px`; // CSSOM: allowed by the CSP
      return bar;
    }));
    bars.append(ns.largest.map((p) => p.tokens).slice(0, 6).join(" "));
    return el("tr", { class: "ns", "data-ns": ns.name },
      el("td", {}, ns.name), el("td", {}, ns.visibility),
      el("td", { class: "num" }, ns.prefixes), el("td", { class: "num" }, ns.tokens),
      el("td", { class: "num" }, size(ns.ram_bytes)),
      el("td", { class: "num" }, size(ns.disk_bytes)),
      el("td", { class: "hits" }, `${ns.cached_tokens ?? 0} / ${ns.prompt_tokens ?? 0} in ` +
        `${ns.served_requests ?? 0} requests`),
      bars);
  }));
}

function renderRecent(recent) {
  document.getElementById("recent").replaceChildren(...recent.map((r) => {
    const when = new Date(r.at * 1000).toLocaleTimeString();
    const head = el("div", { class: "head" },
      el("span", { class: "mono" }, r.id.slice(0, 8)), el("span", {}, when),
      el("span", {}, r.entry ? "from a client" : "from a peer"),
      el("strong", { class: "action" }, r.action));
    if (r.error) head.append(el("span", { class: "err" }, `error ${r.error}`));
    else head.append(
      el("span", {}, `served by `, el("span", { class: "mono served" }, short(r.served_by))),
      el("span", {}, `${r.cached_tokens}/${r.prompt_tokens} prompt tokens cached`),
      el("span", {}, `TTFT ${fixed(r.ttft_ms, 0)} ms, total ${fixed(r.total_ms, 0)} ms`));
    const hops = el("ol", { class: "hops" }, ...r.route.map((h) => el("li", { class: "hop" }, h)));
    return el("li", { class: "request", "data-action": r.action }, head, hops);
  }));
}

function renderSpot(spot) {
  // null: spot checks are off on this node
  document.getElementById("spot").hidden = !spot;
  if (!spot) return;
  const n = spot.counts;
  document.getElementById("spot-counts").textContent =
    `${Math.round(spot.fraction * 100)}% of forwarded answers re-executed here: ` +
    `${n.checks ?? 0} run, ${n.matches ?? 0} match, ${n.drifts ?? 0} drift, ` +
    `${n.mismatches ?? 0} mismatch, ${(n.failed ?? 0) + (n.dropped ?? 0)} not run`;
  document.getElementById("spot-body").replaceChildren(...spot.last.map((e) => el("tr",
    { class: "spot", "data-kind": e.kind },
    el("td", { class: "mono" }, e.request_id.slice(0, 8)),
    el("td", { class: "mono" }, short(e.peer)),
    el("td", { class: e.kind === "mismatch" ? "err" : "" }, e.kind),
    el("td", {}, e.first_mismatch == null ? "-" : `${e.unit} ${e.first_mismatch}`),
    el("td", {}, e.trust_after == null ? "-"
      : `${fixed(e.trust_before, 2)} -> ${fixed(e.trust_after, 2)}`))));
}

let timer = null;

async function poll() {
  const live = document.getElementById("live");
  const headers = { Accept: "application/json" };
  const key = apiKey();
  if (key) headers.Authorization = `Bearer ${key}`;
  try {
    const resp = await fetch("/prefixmesh/overview", { headers, cache: "no-store" });
    if (resp.status === 401 || resp.status === 403) {
      const body = await resp.json().catch(() => ({}));
      document.getElementById("key-form").hidden = false;
      document.getElementById("key-msg").textContent = body.error ? body.error.message : "";
      live.textContent = "needs an API key";
      live.className = "live stale";
      return;
    }
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    const ov = await resp.json();
    renderSelf(ov.node);
    renderModels(ov.node.models || []);
    renderPeers(ov.peers);
    renderCache(ov.namespaces, ov.cache);
    renderRecent(ov.recent);
    renderSpot(ov.spot_checks);
    live.textContent = `live, ${new Date(ov.generated_at * 1000).toLocaleTimeString()}`;
    live.className = "live";
    document.body.dataset.loaded = "1";
  } catch (err) {
    live.textContent = `offline (${err.message})`;
    live.className = "live stale";
  } finally {
    timer = setTimeout(poll, POLL_MS);
  }
}

document.getElementById("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem(KEY_ITEM, document.getElementById("key-input").value);
  document.getElementById("key-form").hidden = true;
  clearTimeout(timer);
  poll();
});

poll();
