"""What py-libp2p 0.8.1's NAT parts really do, measured in the NAT lab (bench/natlab.py).

    python -m prefixmesh.bench.nat_probe relay|dcutr|autonat|failover|limits|all [--json F]

Each scenario builds a :class:`~prefixmesh.bench.natlab.NatLab` (root), starts plain
py-libp2p hosts inside its namespaces as subprocesses (Noise only, Yamux,
``max_connections_per_peer=1``: what overlay/host.py builds) and drives them over
stdin/stdout: the parent sends one JSON action per line, the child answers one JSON
line (``{"id": n, ...}``) and may print events (``{"ev": ...}``) in between. Every action
runs under ``trio.fail_after`` in the child and a queue timeout in the parent; the lab
and every child are torn down in ``finally``. The child's stderr (libp2p logs) goes to
a file under the run's temporary directory, named in the report.

Scenarios
    relay     public relay R (hop), home B reserves at R, home A dials
              ``/ip4/R/tcp/P/p2p/R/p2p-circuit/p2p/B``; echo 1 KB / 100 KB / 1 MB; RTT
              relayed vs direct to a public peer; a simulated inference exchange (4 KB
              up, 50 KB down in 25 chunks over ~60 s, or ``--short`` ~6 s); done for B
              behind an EIM NAT and behind the symmetric NAT.
    limits    the relay's per-circuit byte and duration caps: which exchange they cut.
    dcutr     hole punching A<->B (EIM<->EIM, then EIM<->symmetric), N tries.
    autonat   the library's AutoNAT v1 (its verdict for a public host and for homes),
              identify's observed addresses / NAT type, and our dial-back check
              (``/prefixmesh-probe/dialback/1``: the server dials the claimed address on
              a *fresh* connection, with the peer id checked by Noise).
    failover  B reserved at R1; R1 is killed; B reserves at R2; A reaches B via R2.

The child role is ``python -m prefixmesh.bench.nat_probe _node CONFIG_JSON``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

ECHO_PROTO = "/prefixmesh-probe/echo/1"
DIALBACK_PROTO = "/prefixmesh-probe/dialback/1"
RELAY_PORT = 4001
HOME_PORT = 4101


# ================================================================================
# child side: a py-libp2p host driven over stdin/stdout
# ================================================================================


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _read_exact(stream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await stream.read(min(65536, n - len(buf)))
        buf += chunk
    return bytes(buf)


async def _node_main(cfg: dict) -> None:  # noqa: C901 - one driven host, many actions
    import logging

    import multiaddr
    import trio
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
    from libp2p.custom_types import TProtocol
    from libp2p.network.config import ConnectionConfig
    from libp2p.peer.id import ID
    from libp2p.peer.peerinfo import PeerInfo
    from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
    from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTO
    from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
    from libp2p.relay.circuit_v2.resources import RelayLimits
    from libp2p.relay.circuit_v2.transport import CircuitV2Transport
    from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
    from libp2p.security.noise.transport import Transport as NoiseTransport
    from libp2p.tools.anyio_service import background_trio_service

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if cfg.get("debug"):
        logging.getLogger("libp2p").setLevel(logging.DEBUG)

    kp = create_new_key_pair()
    noise = NoiseTransport(kp, noise_privkey=create_x25519_key_pair().private_key)
    listen = [multiaddr.Multiaddr(f"/ip4/{cfg['ip']}/tcp/{cfg['port']}")]
    host = new_host(
        key_pair=kp,
        sec_opt={TProtocol(NOISE_PROTOCOL_ID): noise},
        connection_config=ConnectionConfig(
            max_connections_per_peer=cfg.get("per_peer", 1), min_connections=0,
            low_watermark=0),
        listen_addrs=listen,
        disable_identify_address_discovery=not cfg.get("observe", True),
    )
    me = host.get_id()
    lim = cfg.get("limits") or {}
    limits = RelayLimits(duration=lim.get("duration", 3600),
                         data=lim.get("data", 1024 * 1024 * 1024),
                         max_circuit_conns=lim.get("conns", 8),
                         max_reservations=lim.get("reservations", 4))
    hop_cls = _fixed_hop_class() if cfg.get("fixed_hop") else CircuitV2Protocol
    relay_proto = hop_cls(host, limits=limits, allow_hop=cfg.get("hop", False))
    # roles STOP only: with CLIENT, CircuitV2Transport.dial also RESERVEs at every relay
    # it dials through (transport.py dial_peer_info)
    transport = CircuitV2Transport(host, relay_proto, RelayConfig(roles=RelayRole.STOP,
                                                                  limits=limits))
    network = host.get_network()

    async def echo_handler(stream) -> None:
        try:
            while True:
                n = int.from_bytes(await _read_exact(stream, 4), "big")
                if n == 0xFFFFFFFF:  # "stream n bytes down in k chunks over t s"
                    spec = json.loads(await _read_exact(
                        stream, int.from_bytes(await _read_exact(stream, 4), "big")))
                    up = await _read_exact(stream, spec["up"])
                    del up
                    for _ in range(spec["chunks"]):
                        await trio.sleep(spec["gap"])
                        await stream.write(b"x" * spec["chunk"])
                    continue
                data = await _read_exact(stream, n)
                for i in range(0, len(data), 65536):
                    await stream.write(data[i:i + 65536])
        except Exception:
            pass
        finally:
            try:
                await stream.close()
            except Exception:
                pass

    async def dialback_handler(stream) -> None:
        """Our reachability check: dial the asker back on a fresh connection at each
        claimed address whose IP is the one we see it at (no amplification)."""
        try:
            req = json.loads(await _read_exact(
                stream, int.from_bytes(await _read_exact(stream, 4), "big")))
            remote = stream.get_remote_address()
            seen_ip = remote[0] if remote else None
            peer = ID.from_base58(req["peer"])
            out = {"seen": f"{remote[0]}:{remote[1]}" if remote else None, "results": []}
            for a in req["addrs"][:4]:
                ma = multiaddr.Multiaddr(a)
                if ma.value_for_protocol("ip4") != seen_ip:
                    out["results"].append({"addr": a, "ok": False, "why": "not seen IP"})
                    continue
                t0 = time.monotonic()
                ok, why = False, "timeout"
                with trio.move_on_after(cfg.get("dialback_timeout", 3.0)):
                    try:
                        conn = await network.dial_addr(ma, peer)
                        ok, why = True, "dialed"
                        try:
                            await conn.close()
                        except Exception:
                            pass
                    except Exception as exc:
                        why = f"{type(exc).__name__}: {str(exc)[:120]}"
                out["results"].append({"addr": a, "ok": ok, "why": why,
                                       "s": round(time.monotonic() - t0, 3)})
            body = json.dumps(out).encode()
            await stream.write(len(body).to_bytes(4, "big") + body)
        except Exception as exc:
            print(f"dialback handler: {exc!r}", file=sys.stderr)
        finally:
            try:
                await stream.close()
            except Exception:
                pass

    host.set_stream_handler(TProtocol(ECHO_PROTO), echo_handler)
    host.set_stream_handler(TProtocol(DIALBACK_PROTO), dialback_handler)

    def relay_of(addr: str) -> tuple[ID, multiaddr.Multiaddr]:
        ma = multiaddr.Multiaddr(addr)
        return ID.from_base58(ma.value_for_protocol("p2p")), ma

    def conn_kinds(peer: ID) -> list[str]:
        kinds = []
        for c in network.get_connections(peer):
            try:
                addrs = [str(a) for a in c.get_transport_addresses()]
            except Exception:
                addrs = []
            kinds.append("relayed" if any("p2p-circuit" in a for a in addrs) else "direct")
        return kinds

    reserved: dict[str, float] = {}
    keeper_state = {"current": None}

    async def reserve_at(addr: str) -> dict:
        rid, ma = relay_of(addr)
        t0 = time.monotonic()
        with trio.fail_after(5):
            await host.connect(PeerInfo(rid, [ma]))
        with trio.fail_after(10):
            stream = await host.new_stream(rid, [HOP_PROTO])
            ok = await transport._make_reservation(stream, rid)
            try:
                await stream.close()
            except Exception:
                pass
        if ok:
            reserved[str(rid)] = time.time()
        proof = transport._reservation_proofs.get(rid)
        return {"ok": ok, "relay": str(rid), "s": round(time.monotonic() - t0, 3),
                "expire_in": (proof.expire - int(time.time())) if proof else None}

    probe_every = cfg.get("probe_every", 2.0)
    probe_timeout = cfg.get("probe_timeout", 2.0)

    async def keeper(relays: list[str]) -> None:
        """Keep one reservation: the first relay that takes it; move on when its
        connection goes (this is OUR logic: the library has no such loop we can use
        without its discovery service)."""
        i = 0
        while True:
            addr = relays[i % len(relays)]
            rid, _ = relay_of(addr)
            try:
                r = await reserve_at(addr)
            except Exception as exc:
                r = {"ok": False, "err": f"{type(exc).__name__}: {str(exc)[:100]}"}
            _emit({"ev": "reserve", "addr": addr, "t": time.time(), **r})
            if r.get("ok"):
                keeper_state["current"] = addr
                why = "connection closed"
                last_probe = time.monotonic()
                while network.get_connections(rid):
                    await trio.sleep(0.1)
                    if time.monotonic() - last_probe < probe_every:
                        continue
                    last_probe = time.monotonic()
                    # a frozen or cut-off relay keeps its TCP connection: probe it
                    try:
                        with trio.fail_after(probe_timeout):
                            await echo(rid, [16], 1)
                    except Exception:
                        why = f"no answer to a probe in {probe_timeout} s"
                        with trio.move_on_after(1):
                            try:
                                await host.disconnect(rid)
                            except Exception:
                                pass
                        break
                keeper_state["current"] = None
                _emit({"ev": "relay_lost", "addr": addr, "t": time.time(), "why": why})
            else:
                await trio.sleep(0.5)
            i += 1

    async def echo(peer: ID, sizes: Sequence[int], reps: int) -> dict:
        with trio.fail_after(10):
            stream = await host.new_stream(peer, [TProtocol(ECHO_PROTO)])
        out = {}
        for size in sizes:
            payload = os.urandom(size)
            times = []
            for _ in range(reps if size <= 4096 else max(1, reps // 10)):
                t0 = time.perf_counter()
                await stream.write(size.to_bytes(4, "big") + payload)
                back = await _read_exact(stream, size)
                times.append(time.perf_counter() - t0)
                if back != payload:
                    raise RuntimeError(f"echo of {size} bytes came back different")
            out[str(size)] = round(statistics.median(times) * 1000, 3)
        await stream.close()
        return {"ms": out, "kinds": conn_kinds(peer)}

    async def stream_down(peer: ID, up: int, chunks: int, chunk: int, gap: float) -> dict:
        with trio.fail_after(10):
            stream = await host.new_stream(peer, [TProtocol(ECHO_PROTO)])
        spec = json.dumps({"up": up, "chunks": chunks, "chunk": chunk, "gap": gap}).encode()
        t0 = time.monotonic()
        got = 0
        err = None
        try:
            await stream.write(b"\xff\xff\xff\xff" + len(spec).to_bytes(4, "big") + spec
                               + os.urandom(up))
            while got < chunks * chunk:
                got += len(await stream.read(65536))
        except Exception as exc:
            err = f"{type(exc).__name__}: {str(exc)[:100]}"
        try:
            await stream.close()
        except Exception:
            pass
        return {"received": got, "wanted": chunks * chunk, "s": round(time.monotonic() - t0, 2),
                "err": err}

    async def act(a: dict, nursery) -> dict:  # noqa: C901
        do = a["do"]
        if do == "info":
            try:
                nat = [str(x) for x in host.get_nat_type()]
            except Exception as exc:
                nat = [repr(exc)]
            mgr = getattr(host, "_observed_addr_manager", None)
            obs = []
            if mgr is not None:
                try:
                    obs = [str(x) for x in mgr.addrs(min_observers=1)]
                except Exception as exc:
                    obs = [repr(exc)]
            return {"peer": str(me), "addrs": [str(x) for x in host.get_addrs()],
                    "observed": obs, "nat_type": nat, "current_relay": keeper_state["current"]}
        if do == "connect":
            pid = ID.from_base58(multiaddr.Multiaddr(a["addr"]).value_for_protocol("p2p"))
            t0 = time.monotonic()
            if a.get("from_listen_port"):  # as DCUtR dials: source = our listen socket
                transport_ma = multiaddr.Multiaddr(a["addr"].rsplit("/p2p/", 1)[0])
                await network.dial_addr(transport_ma, pid, (cfg["ip"], cfg["port"]))
            else:
                await host.connect(PeerInfo(pid, [multiaddr.Multiaddr(a["addr"])]))
            return {"s": round(time.monotonic() - t0, 3)}
        if do == "reserve":
            return await reserve_at(a["addr"])
        if do == "keep_reservation":
            nursery.start_soon(keeper, a["relays"])
            return {"started": True}
        if do == "dial_circuit":
            t0 = time.monotonic()
            conn = await transport.dial(multiaddr.Multiaddr(a["addr"]))
            dest = ID.from_base58(a["addr"].rsplit("/p2p/", 1)[1])
            registered = conn in network.get_connections(dest)
            return {"s": round(time.monotonic() - t0, 3), "registered": registered,
                    "kinds": conn_kinds(dest)}
        if do == "echo":
            return await echo(ID.from_base58(a["peer"]), a["sizes"], a.get("reps", 20))
        if do == "stream_down":
            return await stream_down(ID.from_base58(a["peer"]), a["up"], a["chunks"],
                                     a["chunk"], a["gap"])
        if do == "idle_then_echo":
            peer = ID.from_base58(a["peer"])
            with trio.fail_after(10):
                stream = await host.new_stream(peer, [TProtocol(ECHO_PROTO)])
            res = []
            for wait in a["waits"]:
                await trio.sleep(wait)
                try:
                    with trio.fail_after(5):
                        await stream.write((16).to_bytes(4, "big") + b"y" * 16)
                        await _read_exact(stream, 16)
                    res.append({"after_s": wait, "ok": True})
                except Exception as exc:
                    res.append({"after_s": wait, "ok": False,
                                "err": f"{type(exc).__name__}: {str(exc)[:80]}"})
            return {"results": res}
        if do == "start_dcutr":
            from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
            dcutr = DCUtRProtocol(host, dial_timeout=a.get("dial_timeout", 10))
            host._probe_dcutr = dcutr  # type: ignore[attr-defined]
            await nursery.start(_run_service, background_trio_service, dcutr)
            return {"started": True}
        if do == "hole_punch":
            dcutr = host._probe_dcutr  # type: ignore[attr-defined]
            peer = ID.from_base58(a["peer"])
            t0 = time.monotonic()
            ok = False
            err = None
            try:
                ok = await dcutr.initiate_hole_punch(peer)
            except Exception as exc:
                err = repr(exc)[:200]
            s = time.monotonic() - t0
            # the other side's auto-drive may have won: poll a little for a direct conn
            with trio.move_on_after(a.get("settle", 1.0)):
                while "direct" not in conn_kinds(peer):
                    await trio.sleep(0.05)
            return {"ok": ok, "s": round(s, 3), "err": err, "kinds": conn_kinds(peer),
                    "remote": [str(getattr(c.muxed_conn, "get_remote_address",
                                           lambda: None)())
                               for c in network.get_connections(peer)]}
        if do == "kinds":
            return {"kinds": conn_kinds(ID.from_base58(a["peer"]))}
        if do == "autonat":
            from libp2p.host.autonat.autonat import AutoNATService
            svc = AutoNATService(host, serve=False)
            sid, sma = relay_of(a["server"])
            with trio.fail_after(5):
                await host.connect(PeerInfo(sid, [sma]))
            addrs = None
            if a.get("addrs"):
                addrs = [multiaddr.Multiaddr(x).to_bytes() for x in a["addrs"]]
            status, addr = await svc.query_server(sid, addrs=addrs, timeout=10)
            names = {0: "OK", 100: "E_DIAL_ERROR", 101: "E_DIAL_REFUSED",
                     200: "E_BAD_REQUEST", 300: "E_INTERNAL_ERROR"}
            return {"status": names.get(status, status),
                    "addr": str(multiaddr.Multiaddr(addr)) if addr else None,
                    "advertised": [str(multiaddr.Multiaddr(x)) for x in addrs] if addrs
                    else [str(x) for x in host.get_addrs()]}
        if do == "dialback":
            sid, sma = relay_of(a["server"])
            with trio.fail_after(5):
                await host.connect(PeerInfo(sid, [sma]))
            with trio.fail_after(10):
                stream = await host.new_stream(sid, [TProtocol(DIALBACK_PROTO)])
                body = json.dumps({"peer": str(me), "addrs": a["addrs"]}).encode()
                await stream.write(len(body).to_bytes(4, "big") + body)
                resp = json.loads(await _read_exact(
                    stream, int.from_bytes(await _read_exact(stream, 4), "big")))
                await stream.close()
            return resp
        if do == "serve_autonat":
            from libp2p.host.autonat.autonat import AutoNATService
            host._probe_autonat = AutoNATService(host, serve=True)  # type: ignore
            return {"started": True}
        if do == "sleep":
            await trio.sleep(a["s"])
            return {}
        raise ValueError(f"unknown action {do!r}")

    async with host.run(listen_addrs=listen):
        async with background_trio_service(relay_proto), trio.open_nursery() as nursery:
            _emit({"ev": "ready", "peer": str(me),
                   "addr": f"/ip4/{cfg['ip']}/tcp/{cfg['port']}/p2p/{me}"})
            while True:
                line = await trio.to_thread.run_sync(sys.stdin.readline,
                                                     abandon_on_cancel=True)
                if not line:
                    break
                a = json.loads(line)
                t0 = time.monotonic()
                try:
                    with trio.fail_after(a.get("timeout", 30)):
                        res = await act(a, nursery)
                    _emit({"id": a["id"], "ok": True, **res})
                except BaseException as exc:  # noqa: BLE001 - report everything
                    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                        raise
                    _emit({"id": a["id"], "ok": False,
                           "err": f"{type(exc).__name__}: {str(exc)[:300]}",
                           "s": round(time.monotonic() - t0, 3)})
            nursery.cancel_scope.cancel()
    os._exit(0)  # libp2p's background tasks can keep the process alive


def _fixed_hop_class():
    """Our fixed circuit-relay hop (``overlay/relay.py`` ``FixedHop``: own streams only,
    deadline over the whole splice, circuits of a closed connection cut, bytes counted;
    the node's relay service adds its admission and pacing limits to it)."""
    from prefixmesh.overlay.relay import FixedHop

    return FixedHop


async def _run_service(bg, service, *, task_status):
    import trio
    async with bg(service):
        task_status.started()
        await trio.sleep_forever()


# ================================================================================
# parent side
# ================================================================================


class Node:
    """A child host process inside a lab namespace, driven line by line."""

    def __init__(self, lab, ns: str, name: str, logdir: str, **cfg):
        self.name = name
        self.log = os.path.join(logdir, f"{name}.log")
        self._err = open(self.log, "w")
        argv = [sys.executable, "-m", "prefixmesh.bench.nat_probe", "_node", json.dumps(cfg)]
        self.proc = lab.popen(ns, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=self._err, text=True, bufsize=1)
        self.q: queue.Queue = queue.Queue()
        self.events: list[dict] = []
        self._n = 0
        threading.Thread(target=self._reader, daemon=True).start()
        ready = self.wait_event("ready", 30)
        self.peer, self.addr = ready["peer"], ready["addr"]

    def _reader(self) -> None:
        for line in self.proc.stdout:
            try:
                self.q.put(json.loads(line))
            except ValueError:
                pass
        self.q.put({"ev": "exit"})

    def _next(self, deadline: float) -> dict:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{self.name}: no answer in time (log: {self.log})")
        try:
            msg = self.q.get(timeout=left)
        except queue.Empty:
            raise TimeoutError(f"{self.name}: no answer in time (log: {self.log})") from None
        if msg.get("ev") == "exit":
            raise RuntimeError(f"{self.name} exited (log: {self.log})")
        return msg

    def wait_event(self, ev: str, timeout: float, pred=lambda m: True) -> dict:
        for m in self.events:
            if m.get("ev") == ev and pred(m) and not m.get("_seen"):
                m["_seen"] = True
                return m
        deadline = time.monotonic() + timeout
        while True:
            m = self._next(deadline)
            if "ev" in m:
                self.events.append(m)
                if m["ev"] == ev and pred(m):
                    m["_seen"] = True
                    return m

    def call(self, do: str, timeout: float = 30, **kw) -> dict:
        self._n += 1
        msg = {"id": self._n, "do": do, "timeout": timeout, **kw}
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout + 10
        while True:
            m = self._next(deadline)
            if "ev" in m:
                self.events.append(m)
            elif m.get("id") == self._n:
                return m

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self._err.close()


class Scenario:
    """A lab plus the nodes started in it; closes both."""

    def __init__(self, homes_nat=("eim", "eim", "symmetric"), public_hosts=2,
                 routers_drop: bool = False):
        from .natlab import NatLab
        self.lab = NatLab(homes_nat=homes_nat, public_hosts=public_hosts)
        self.routers_drop = routers_drop
        self.logdir = tempfile.mkdtemp(prefix="nat_probe_")
        self.nodes: list[Node] = []

    def __enter__(self):
        self.lab.open()
        try:
            if self.routers_drop:
                for h in self.lab.homes:
                    r = self.lab.run(h.router_ns, ["nft", "-f", "-"], input=ROUTER_DROP)
                    if r.returncode != 0:
                        raise RuntimeError(f"nft in {h.router_ns}: {r.stderr.strip()}")
        except BaseException:
            self.lab.close()
            raise
        return self

    def __exit__(self, *exc):
        for n in self.nodes:
            n.kill()
        self.lab.close()

    def extra_public_ns(self, ip: str) -> str:
        """One more public host in a namespace of its own on the lab's bridge (the lab's
        public hosts share one namespace, so they see each other at the wrong source
        address); it is deleted with the lab."""
        lab = self.lab
        ns = f"{lab.prefix}-x{ip.rsplit('.', 1)[1]}"
        veth = f"{lab.prefix}x{ip.rsplit('.', 1)[1]}"
        steps = [["ip", "netns", "add", ns],
                 ["ip", "-n", ns, "link", "set", "lo", "up"],
                 ["ip", "link", "add", veth, "netns", ns, "type", "veth", "peer", "name",
                  veth + "b", "netns", lab.public_ns],
                 ["ip", "-n", lab.public_ns, "link", "set", veth + "b", "master", "br0", "up"],
                 ["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", veth],
                 ["ip", "-n", ns, "link", "set", veth, "up"]]
        for i, argv in enumerate(steps):
            r = subprocess.run(argv, capture_output=True, text=True)
            if i == 0 and r.returncode == 0:
                lab._made.append(ns)  # NatLab.close deletes it with the others
            if r.returncode != 0:
                raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}")
        return ns

    def public(self, i: int, name: str, port: int = RELAY_PORT, **cfg) -> Node:
        n = Node(self.lab, self.lab.public_ns, name, self.logdir, ip=self.lab.public_ip(i),
                 port=port, **cfg)
        self.nodes.append(n)
        return n

    def home(self, k: int, name: str, port: int = HOME_PORT, **cfg) -> Node:
        h = self.lab.homes[k]
        n = Node(self.lab, h.ns, name, self.logdir, ip=h.ip, port=port, **cfg)
        self.nodes.append(n)
        return n


def circuit(relay: Node, dest: Node) -> str:
    return f"{relay.addr}/p2p-circuit/p2p/{dest.peer}"


#: A router that silently drops unsolicited inbound TCP SYNs (most home routers: "stealth")
#: instead of answering them with a RST from its own stack (what a bare Linux router
#: namespace does). Packets matching a NAT mapping are forwarded before this (they go
#: through FORWARD, not INPUT), so only SYNs to the router itself are dropped.
ROUTER_DROP = """table inet probe_filter {
 chain input { type filter hook input priority 0; policy accept;
  iifname "wan" tcp flags & (syn | ack) == syn drop
 }
}
"""

SIZES = [1024, 100 * 1024, 1024 * 1024]


def probe_relay(short: bool = False, limits: dict | None = None,
                fixed_hop: bool = False) -> dict:
    """Reservation + relayed echo, B behind EIM then behind symmetric NAT."""
    out: dict = {"limits": limits or "library defaults (3600 s, 1 GiB)",
                 "splice": "ours (FixedHop)" if fixed_hop else "library"}
    with Scenario() as sc:
        relay = sc.public(0, "relay", hop=True, limits=limits, fixed_hop=fixed_hop)
        pub = sc.public(1, "public2")
        a = sc.home(0, "A")
        direct = a.call("connect", addr=pub.addr, timeout=10)
        out["direct_connect_s"] = direct.get("s")
        out["direct_echo"] = a.call("echo", peer=pub.peer, sizes=SIZES, timeout=60)
        for k, label in ((1, "eim"), (2, "symmetric")):
            b = sc.home(k, f"B_{label}")
            t0 = time.monotonic()
            res = b.call("reserve", addr=relay.addr, timeout=20)
            r = {"reserve": res, "start_to_reserved_s": round(time.monotonic() - t0, 3)}
            r["dial"] = a.call("dial_circuit", addr=circuit(relay, b), timeout=30)
            if r["dial"]["ok"]:
                r["echo"] = a.call("echo", peer=b.peer, sizes=SIZES, timeout=90)
                chunks, gap = (25, 2.4) if not short else (25, 0.24)
                r["inference_like"] = a.call("stream_down", peer=b.peer, up=4096,
                                             chunks=chunks, chunk=2048, gap=gap,
                                             timeout=120)
            out[f"B_behind_{label}"] = r
    return out


def probe_limits() -> dict:
    """The relay's caps: 128 KiB / 30 s (go-libp2p's style of defaults, smaller
    duration to keep the run short): what gets cut, and when."""
    out = {}
    with Scenario(homes_nat=("eim", "eim"), public_hosts=1) as sc:
        relay = sc.public(0, "relay", hop=True,
                          limits={"duration": 8, "data": 128 * 1024})
        a, b = sc.home(0, "A"), sc.home(1, "B")
        out["reserve"] = b.call("reserve", addr=relay.addr, timeout=20)
        out["dial"] = a.call("dial_circuit", addr=circuit(relay, b), timeout=30)
        out["echo_1k"] = a.call("echo", peer=b.peer, sizes=[1024], reps=5, timeout=30)
        out["echo_100k"] = a.call("echo", peer=b.peer, sizes=[100 * 1024], reps=1,
                                  timeout=30)
        out["kinds_after_cap"] = a.call("kinds", peer=b.peer)
        out["redial"] = a.call("dial_circuit", addr=circuit(relay, b), timeout=30)
        out["idle_then_echo"] = a.call("idle_then_echo", peer=b.peer,
                                       waits=[1, 10, 0.5, 0.5], timeout=40)
    # two circuits to the same destination, through a relay with generous caps: does the
    # end of one (its dialer killed) take the other down? The library's hop, then ours.
    for fixed in (False, True):
        out["two_circuits_same_destination" + ("_fixed_hop" if fixed else "")] = \
            _two_circuits(fixed)
    with Scenario(homes_nat=("eim", "eim"), public_hosts=1) as sc:
        relay = sc.public(0, "relay", hop=True, fixed_hop=True,
                          limits={"duration": 8, "data": 128 * 1024})
        a, b = sc.home(0, "A"), sc.home(1, "B")
        b.call("reserve", addr=relay.addr, timeout=20)
        f: dict = {"dial": a.call("dial_circuit", addr=circuit(relay, b), timeout=30)}
        f["echo_100k"] = a.call("echo", peer=b.peer, sizes=[100 * 1024], reps=1, timeout=30)
        a.call("dial_circuit", addr=circuit(relay, b), timeout=30)
        f["idle_then_echo"] = a.call("idle_then_echo", peer=b.peer, waits=[1, 10],
                                     timeout=40)
        out["caps_fixed_hop"] = f
    return out


def _two_circuits(fixed: bool) -> dict:
    with Scenario(homes_nat=("eim", "eim"), public_hosts=1) as sc:
        relay = sc.public(0, "relay", hop=True, fixed_hop=fixed)
        a1, a2 = sc.home(0, "A1"), sc.home(0, "A2", port=HOME_PORT + 1)
        b = sc.home(1, "B")
        b.call("reserve", addr=relay.addr, timeout=20)
        a1.call("dial_circuit", addr=circuit(relay, b), timeout=30)
        a2.call("dial_circuit", addr=circuit(relay, b), timeout=30)
        c: dict = {"a2_echo_before": a2.call("echo", peer=b.peer, sizes=[1024], reps=3)}
        a1.kill()
        time.sleep(3)
        c["a2_echo_after_a1_killed_idle"] = a2.call("echo", peer=b.peer, sizes=[1024], reps=3)
        c["b_kinds_for_a1_after_kill"] = b.call("kinds", peer=a1.peer)
        # B still holds its (dead) connection to A1 and writes to it, as a server would
        c["b_writes_to_dead_a1"] = b.call("echo", peer=a1.peer, sizes=[16], reps=1, timeout=8)
        time.sleep(1)
        c["a2_kinds_after_a1_killed"] = a2.call("kinds", peer=b.peer)
        c["a2_echo_after_a1_killed"] = a2.call("echo", peer=b.peer, sizes=[1024], reps=3)
        return c


def probe_dcutr(tries: int = 10, observe: bool = True, routers_drop: bool = True,
                per_peer: int = 1, dial_timeout: float = 10) -> dict:
    out: dict = {"observe": observe, "tries": tries, "routers_drop": routers_drop,
                 "max_connections_per_peer": per_peer, "dcutr_dial_timeout": dial_timeout}
    with Scenario(routers_drop=routers_drop) as sc:
        relay = sc.public(0, "relay", hop=True)
        for k, label in ((1, "eim"), (2, "symmetric")):
            b = sc.home(k, f"B_{label}", observe=observe, per_peer=per_peer)
            b.call("start_dcutr", dial_timeout=dial_timeout)
            b.call("reserve", addr=relay.addr, timeout=20)
            runs = []
            for i in range(tries):
                a = sc.home(0, f"A_{label}_{i}", port=HOME_PORT + 10 + i, observe=observe,
                            per_peer=per_peer)
                try:
                    a.call("start_dcutr", dial_timeout=dial_timeout)
                    d = a.call("dial_circuit", addr=circuit(relay, b), timeout=30)
                    if not d["ok"]:
                        runs.append({"dial": d})
                        continue
                    # identify on the relay connection gives the observed address
                    a.call("sleep", s=0.5)
                    hp = a.call("hole_punch", peer=b.peer, timeout=60, settle=3.0)
                    run = {"hole_punch": hp}
                    run["echo_after"] = a.call("echo", peer=b.peer, sizes=[1024], reps=10,
                                               timeout=30)
                    if i == 0:
                        run["a_info"] = a.call("info")
                        run["b_info"] = b.call("info")
                    runs.append(run)
                finally:
                    a.kill()
                    sc.nodes.remove(a)
                    # let the relay finish the dead circuit first: its clean-up closes
                    # whatever circuit to B it holds at that moment (see docs/bench/nat.md)
                    time.sleep(1.5)
            ok = [r for r in runs if "direct" in (r.get("hole_punch") or {}).get("kinds", [])]
            out[f"B_behind_{label}"] = {
                "runs": runs,
                "direct": len(ok),
                "time_s": [r["hole_punch"]["s"] for r in runs if "hole_punch" in r],
            }
    return out


def probe_autonat() -> dict:
    out: dict = {}
    with Scenario() as sc:
        s1 = sc.public(0, "server1")
        s2 = sc.public(1, "server2")
        s1.call("serve_autonat")
        s2.call("serve_autonat")
        xns = sc.extra_public_ns("198.18.0.50")
        pub_client = Node(sc.lab, xns, "public_client", sc.logdir, ip="198.18.0.50",
                          port=RELAY_PORT)
        sc.nodes.append(pub_client)
        homes = {"eim": sc.home(0, "home_eim"), "symmetric": sc.home(2, "home_sym")}
        # identify's observed addresses need connections to a few public peers; the
        # connections leave from the listen port (as DCUtR's dials do), so what a server
        # sees is the NAT's mapping of the listen port
        for n in (pub_client, *homes.values()):
            n.call("connect", addr=s1.addr, timeout=10, from_listen_port=True)
            n.call("connect", addr=s2.addr, timeout=10, from_listen_port=True)
        time.sleep(1.0)
        for name, n in (("public", pub_client), *homes.items()):
            r: dict = {"info": n.call("info")}
            r["library_autonat_default_addrs"] = n.call("autonat", server=s1.addr)
            if name == "public":
                claimed = [pub_client.addr.rsplit("/p2p/", 1)[0]]
            else:
                h = sc.lab.homes[0 if name == "eim" else 2]
                claimed = [f"/ip4/{h.wan_ip}/tcp/{HOME_PORT}"]
            r["claimed"] = claimed
            r["library_autonat_claimed"] = n.call("autonat", server=s1.addr, addrs=claimed)
            r["ours_dialback_claimed"] = n.call("dialback", server=s2.addr, addrs=claimed)
            # our NAT-type check: the port two servers see for connections from our
            # listen port (same as the listen port at both: port-preserving, endpoint-
            # independent mapping, hole punching can work; different: symmetric)
            seen = [n.call("dialback", server=s.addr, addrs=[]).get("seen") for s in (s1, s2)]
            r["seen_by_two_servers"] = seen
            ports = {x.rsplit(":", 1)[1] for x in seen if x}
            r["our_nat_verdict"] = (
                "public" if r["ours_dialback_claimed"].get("results", [{}])[0].get("ok")
                else "private, port-preserving (hole punch possible)"
                if ports == {str(n.addr.split("/")[4])}
                else "private, symmetric (relay only)")
            out[name] = r
    return out


def probe_failover() -> dict:
    return {"relay_killed": _failover("kill"), "relay_frozen": _failover("freeze")}


def _failover(how: str) -> dict:
    """``kill``: the relay process dies (its kernel closes the TCP connections);
    ``freeze``: SIGSTOP, connections stay open and nothing answers (a hung host or a
    cut cable looks the same until TCP gives up, which takes minutes)."""
    import signal
    out: dict = {"how": how}
    with Scenario(homes_nat=("eim", "eim"), public_hosts=2) as sc:
        r1 = sc.public(0, "relay1", hop=True)
        r2 = sc.public(1, "relay2", hop=True)
        a, b = sc.home(0, "A"), sc.home(1, "B")
        t0 = time.monotonic()
        b.call("keep_reservation", relays=[r1.addr, r2.addr])
        ev = b.wait_event("reserve", 20, lambda m: m.get("ok"))
        out["first_reservation"] = {"relay": ev["addr"] == r1.addr and "R1",
                                    "s": round(time.monotonic() - t0, 3)}
        out["via_r1"] = a.call("dial_circuit", addr=circuit(r1, b), timeout=30)
        out["echo_r1"] = a.call("echo", peer=b.peer, sizes=[1024], reps=5, timeout=30)
        t_kill = time.time()
        if how == "kill":
            r1.kill()
        else:
            r1.proc.send_signal(signal.SIGSTOP)
        lost = b.wait_event("relay_lost", 30)
        ev2 = b.wait_event("reserve", 30, lambda m: m.get("ok"))
        out["relay_lost_after_s"] = round(lost["t"] - t_kill, 3)
        out["relay_lost_why"] = lost.get("why")
        out["reserved_r2_after_s"] = round(ev2["t"] - t_kill, 3)
        out["reserved_at"] = "R2" if ev2["addr"] == r2.addr else ev2["addr"]
        out["a_kinds_after_kill"] = a.call("kinds", peer=b.peer)
        t1 = time.monotonic()
        out["via_r2"] = a.call("dial_circuit", addr=circuit(r2, b), timeout=30)
        out["echo_r2"] = a.call("echo", peer=b.peer, sizes=[1024], reps=5, timeout=30)
        out["kill_to_echo_ok_s"] = round(time.time() - t_kill, 3)
        out["redial_s"] = round(time.monotonic() - t1, 3)
        if how == "freeze":
            r1.proc.send_signal(signal.SIGCONT)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_node":
        import trio
        trio.run(_node_main, json.loads(argv[1]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["relay", "limits", "dcutr", "autonat", "failover", "all"])
    p.add_argument("--short", action="store_true", help="inference-like exchange over ~6 s")
    p.add_argument("--tries", type=int, default=10)
    p.add_argument("--fixed-hop", action="store_true", help="relay: our splice (FixedHop)")
    p.add_argument("--no-observe", action="store_true",
                   help="dcutr with identify address discovery off (as overlay/host.py)")
    p.add_argument("--routers-rst", action="store_true",
                   help="dcutr with routers answering unsolicited SYNs with RST (bare Linux)")
    p.add_argument("--dial-timeout", type=float, default=10,
                   help="DCUtRProtocol(dial_timeout=): also bounds its unilateral first dial")
    p.add_argument("--per-peer", type=int, default=1, help="max_connections_per_peer")
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args(argv)
    from .natlab import lab_unavailable_reason
    reason = lab_unavailable_reason()
    if reason:
        print(f"NAT lab unavailable: {reason}", file=sys.stderr)
        return 2
    results = {}
    todo = ["relay", "limits", "dcutr", "autonat", "failover"] if args.what == "all" \
        else [args.what]
    for what in todo:
        t0 = time.monotonic()
        if what == "relay":
            results[what] = probe_relay(short=args.short, fixed_hop=args.fixed_hop)
        elif what == "limits":
            results[what] = probe_limits()
        elif what == "dcutr":
            results[what] = probe_dcutr(args.tries, observe=not args.no_observe,
                                        routers_drop=not args.routers_rst,
                                        per_peer=args.per_peer,
                                        dial_timeout=args.dial_timeout)
        elif what == "autonat":
            results[what] = probe_autonat()
        elif what == "failover":
            results[what] = probe_failover()
        results[what]["wall_s"] = round(time.monotonic() - t0, 1)
        print(json.dumps({what: results[what]}, indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
