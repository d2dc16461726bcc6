"""The one configuration model of a prefixmesh node (and of the CLI client).

Sources, later ones win: built-in defaults < a TOML file (``--config FILE``) < command-line
flags. Every flag of ``prefixmesh node`` maps to exactly one key (:data:`NODE_FLAGS`), and
``prefixmesh node --print-config`` prints the effective configuration as TOML that loads
back to the same configuration (secrets are redacted: shown as comments).

Validation is strict and happens once, at load: unknown sections or keys, wrong types and
bad values are :class:`ConfigError`, whose message names the key path and the problem::

    [node].ram_budget: "12 parsecs" is not a size (use e.g. 512MiB, 2GB)
    --listen: "/ip4/1.2.3/tcp/0" is not a multiaddr: ...

Sections and keys (defaults in parentheses; see ``examples/volunteer-node.toml``):

``[node]``
    ``listen`` (``/ip4/127.0.0.1/tcp/0``): libp2p listen multiaddr ``/ip4|ip6/ADDR/tcp/PORT``.
    An unspecified address (0.0.0.0, ::) is refused unless ``advertise`` is set, because
    peers cannot dial 0.0.0.0 (mDNS would advertise it verbatim).
    ``advertise`` ([]): multiaddrs to announce instead of the listen address.
    ``bootstrap`` ([]): peers to dial at start, ``/ip4|ip6|dns|dns4|dns6/HOST/tcp/PORT/p2p/ID``.
    ``mdns`` (true): LAN discovery. ``key_file`` (``keys/node.key``): the node identity.
    ``cache_dir`` (``<cache>/kv``, see ``inference.model.cache_dir``): KV state on disk.
    ``ram_budget`` (1GiB) / ``disk_budget`` (8GiB): KV cache budgets (sizes, see ``sizes``).
    ``log_level`` ("info"): error | warning | info | debug. ``log_format`` ("text"): text |
    json (one JSON object per line; ``node/logsetup.py``).
``[model]``
    ``path`` (absent: the embedded default model), ``n_ctx`` (4096), ``n_threads`` (0: llama.cpp
    picks), ``n_gpu_layers`` (0).
``[digest]`` (cache-digest anti-entropy)
    ``interval_s`` (1.0), ``fanout`` (3), ``byte_budget`` (64KiB per exchange), ``ttl_s`` (900),
    ``refresh_interval_s`` (300: liveness and load are the membership's, PONGs / ACKs; a
    record says what is cached, and every cache change is a record of its own; a dead
    origin's records outlive it but routing only picks up peers; a refresh every 20 s
    made idle digests cost ~3.7 KB/s per node at N=32), ``min_record_interval_s`` (0: batch own changes into at
    most one delta per that many seconds; 5 cut loaded digest traffic by a fifth in the
    simulator for -1 % hits). ``partitions`` (0 = full replication; 1..65536 turns on
    partial replication, ``overlay.partition``: each prefix's records live at ``replicas``
    (3, 1..16) home nodes and other routers look them up), ``partition_refresh_s`` (300)
    and ``partition_ttl_s`` (900): the refresh and lifetime of partition records (long:
    node liveness is the heartbeats' job, not the digests').
``[routing]``
    ``policy`` ("prefixmesh"), ``deadline_s`` (default request deadline, 60), ``hop_budget``
    (2); ``share_cap`` (false): no peer gets more than half of this node's last 100 forwards
    (``overlay.core.limits.ForwardShareLimiter``; off by default because in swarms of 2-3
    nodes it halves legitimate forwarding); ``spot_check_fraction`` (0.0, 0..1): that
    fraction of the forwarded greedy requests a peer answered in full is re-executed here
    afterwards and compared, a mismatch lowers the peer's trust (``overlay.core.trust``).
    Every other key must be a field of ``overlay.routing.RoutingConfig`` and have the type
    of its default.
``[limits]`` (per-peer input limits; each peer has its own token bucket)
    ``peer_request_rate`` (50.0 inference requests/s) and ``peer_request_burst`` (100): what
    one peer may send on ``/prefixmesh/infer``; ``max_peers_per_subnet`` (4; 0 = no cap):
    peers of one IPv4 /24 or IPv6 /48 considered in one routing decision;
    ``digest_exchange_rate`` (4.0 exchanges/s) and ``digest_exchange_burst`` (8): digest
    exchanges answered for one peer. Rates must be > 0 and bursts >= 1. An honest peer
    opens about ``1 / [digest].interval_s`` exchanges/s with any one node, so keep
    ``digest_exchange_rate`` at least that (the daemon warns otherwise).
``[http]``
    ``listen`` ("": off) ``HOST:PORT`` of the HTTP gateway; ``api_key`` (""). A gateway on a
    non-loopback address requires an api_key.
``[metrics]``
    ``listen`` ("": off) ``HOST:PORT`` serving only ``/metrics``, ``/prefixmesh/overview`` and
    ``/dashboard`` (for a node without the gateway; off loopback it requires [http].api_key).
``[client]`` (used by ``chat``/``ask``/``peers``)
    ``peer`` (""): the node to talk to, a multiaddr with ``/p2p/ID``; ``tenant`` ("public");
    ``max_tokens`` (512); ``timeout_s`` (60): the deadline of one answer (the node stops
    working on it then too).
``[tenants.NAME]``: see :mod:`prefixmesh.node.tenants`.

Relative paths in a file are relative to that file's folder; relative defaults and flag
values are relative to the working directory. All paths are absolute after loading.

Multiaddrs are checked structurally here (no libp2p import): protocol names, IP syntax,
host names, port ranges and base58 peer ids.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixmesh.inference.options import BATCH_MODES, KV_TYPES
from prefixmesh.overlay.core.limits import (
    MAX_PEERS_PER_SUBNET,
    PEER_REQUEST_BURST,
    PEER_REQUEST_RATE,
)
from prefixmesh.overlay.core.routing import DEPLOYABLE_POLICIES
from prefixmesh.overlay.digestexchange import ExchangeSettings

from .sizes import SIZE_HINT, SizeError, format_size, parse_size
from .tenants import TenantConfigError, TenantSpec, default_tenant_specs, parse_tenant

__all__ = [
    "ConfigError",
    "Config",
    "NodeSection",
    "ModelSection",
    "DigestSection",
    "RoutingSection",
    "LimitsSection",
    "HttpSection",
    "ClientSection",
    "FlagSpec",
    "NODE_FLAGS",
    "POLICY_NAMES",
    "LOG_LEVELS",
    "LOG_FORMATS",
    "DEFAULT_LISTEN",
    "load_config",
    "config_to_toml",
    "parse_multiaddr",
    "check_listen_addr",
    "check_peer_addr",
    "default_cache_dir",
]

DEFAULT_LISTEN = "/ip4/127.0.0.1/tcp/0"
#: what [routing] policy accepts: the deployable policies only (overlay/core/routing.py);
#: the baselines are for the simulator and benchmarks (bench/policies.py, bench/node_entry.py)
POLICY_NAMES = DEPLOYABLE_POLICIES
# the digest exchange's defaults: [digest] and [limits] take theirs from here (one default
# per knob, overlay/digestexchange.py)
_EXCHANGE = ExchangeSettings()
LOG_LEVELS = ("error", "warning", "info", "debug")
LOG_FORMATS = ("text", "json")
MAX_CONFIG_BYTES = 1024 * 1024
_MAX_ADDRS = 64
_REDACTED = "(redacted)"


class ConfigError(ValueError):
    """A configuration problem. ``where`` is the key path or flag (``[node].listen``)."""

    def __init__(self, where: str, problem: str):
        self.where = where
        self.problem = problem
        super().__init__(f"{where}: {problem}" if where else problem)


class _Bad(Exception):
    """Raised by value checkers; the loader adds the key path."""


def default_cache_dir() -> Path:
    try:
        from prefixmesh.inference.model import cache_dir
    except ImportError:  # keep config usable if the model module is broken
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return Path(base) / "prefixmesh" / "kv"
    return cache_dir() / "kv"


# --- multiaddrs -------------------------------------------------------------------------

_HOST_RE = re.compile(
    r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$"
)
_HOST_PROTOS = ("ip4", "ip6", "dns", "dns4", "dns6")


def parse_multiaddr(text: object) -> list[tuple[str, str]]:
    """``/ip4/1.2.3.4/tcp/5/p2p/ID`` -> [("ip4", "1.2.3.4"), ("tcp", "5"), ("p2p", ID)].

    Knows the protocols a TCP libp2p address uses; raises :class:`_Bad` with the reason.
    """
    if not isinstance(text, str):
        raise _Bad(f"must be a multiaddr string, not {_type_name(text)}")
    shown = f'"{text}"'
    if not text.startswith("/"):
        raise _Bad(f"{shown} is not a multiaddr (it starts with '/', e.g. {DEFAULT_LISTEN})")
    parts = text[1:].split("/")
    out: list[tuple[str, str]] = []
    i = 0
    while i < len(parts):
        proto = parts[i]
        if proto not in (*_HOST_PROTOS, "tcp", "p2p"):
            raise _Bad(f"{shown} is not a multiaddr: unsupported protocol '{proto}' "
                       "(use /ip4|ip6|dns/HOST/tcp/PORT[/p2p/PEER_ID])")
        if i + 1 >= len(parts) or parts[i + 1] == "":
            raise _Bad(f"{shown} is not a multiaddr: /{proto} needs a value")
        value = parts[i + 1]
        try:
            if proto == "ip4":
                ipaddress.IPv4Address(value)
            elif proto == "ip6":
                ipaddress.IPv6Address(value)
            elif proto.startswith("dns"):
                if not _HOST_RE.match(value):
                    raise ValueError
            elif proto == "tcp":
                if not value.isdigit() or not 0 <= int(value) <= 65535:
                    raise ValueError
            elif proto == "p2p":
                from prefixmesh.overlay.core.identity import IdentityError, peer_id_from_b58

                try:
                    peer_id_from_b58(value)
                except IdentityError:
                    raise ValueError from None
        except ValueError:
            what = {"ip4": "an IPv4 address", "ip6": "an IPv6 address", "tcp": "a TCP port",
                    "p2p": "a peer id (12D3KooW...)"}.get(proto, "a host name")
            raise _Bad(f"{shown} is not a multiaddr: '{value}' is not {what}") from None
        out.append((proto, value))
        i += 2
    return out


def _addr_shape(text: str, parts: list[tuple[str, str]], *, host_protos: tuple[str, ...],
                p2p: str) -> None:
    names = [p for p, _ in parts]
    want = "/" + "|".join(host_protos) + "/HOST/tcp/PORT" + {
        "required": "/p2p/PEER_ID", "optional": "[/p2p/PEER_ID]", "forbidden": ""}[p2p]
    ok = (len(names) in (2, 3) and names[0] in host_protos and names[1] == "tcp"
          and (len(names) == 2 or names[2] == "p2p"))
    if ok and p2p == "required" and len(names) != 3:
        raise _Bad(f'"{text}" lacks the peer id: expected {want}')
    if ok and p2p == "forbidden" and len(names) != 2:
        raise _Bad(f'"{text}": a listen address has no /p2p part: expected {want}')
    if not ok:
        raise _Bad(f'"{text}" has the wrong shape: expected {want}')


def check_listen_addr(text: object) -> str:
    parts = parse_multiaddr(text)
    assert isinstance(text, str)
    _addr_shape(text, parts, host_protos=("ip4", "ip6"), p2p="forbidden")
    return text


def check_peer_addr(text: object) -> str:
    """A dialable peer address: ``/ip4|ip6|dns/HOST/tcp/PORT/p2p/PEER_ID`` with PORT > 0."""
    parts = parse_multiaddr(text)
    assert isinstance(text, str)
    _addr_shape(text, parts, host_protos=_HOST_PROTOS, p2p="required")
    if int(parts[1][1]) == 0 or _unspecified(parts[0][1]):
        raise _Bad(f'"{text}" is not dialable (port 0 or unspecified address)')
    return text


def _check_advertise_addr(text: object) -> str:
    parts = parse_multiaddr(text)
    assert isinstance(text, str)
    _addr_shape(text, parts, host_protos=_HOST_PROTOS, p2p="optional")
    if int(parts[1][1]) == 0 or _unspecified(parts[0][1]):
        raise _Bad(f'"{text}" is not dialable (port 0 or unspecified address)')
    return text


def _unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def is_loopback_host(host: str) -> bool:
    """``localhost`` or a loopback IP literal (the one check config and gateway share)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# --- value checkers (value, base_dir) -> normalized value -------------------------------

Checker = Callable[[Any, Path], Any]


def _type_name(value: object) -> str:
    return {
        str: "a string", int: "an integer", float: "a float", bool: "a boolean",
        list: "a list", dict: "a table",
    }.get(type(value), type(value).__name__)


def _show(value: object) -> str:
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _bool(value: Any, _base: Path) -> bool:
    if not isinstance(value, bool):
        raise _Bad(f"must be true or false, not {_type_name(value)} {_show(value)}")
    return value


def _int(lo: int, hi: int) -> Checker:
    def check(value: Any, _base: Path) -> int:
        if isinstance(value, str) and re.fullmatch(r"-?\d{1,30}", value.strip()):
            value = int(value)  # from a flag (longer digit strings can't be in range anyway)
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Bad(f"must be an integer, not {_type_name(value)} {_show(value)}")
        if not lo <= value <= hi:
            raise _Bad(f"{value} is out of range ({lo}..{hi})")
        return value
    return check


def _float(lo: float, hi: float, *, lo_open: bool = False) -> Checker:
    def check(value: Any, _base: Path) -> float:
        if isinstance(value, str):  # from a flag
            try:
                value = float(value)
            except ValueError:
                raise _Bad(f"{_show(value)} is not a number") from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _Bad(f"must be a number, not {_type_name(value)} {_show(value)}")
        try:
            v = float(value)
        except OverflowError:
            raise _Bad(f"{_show(value)} is out of range (at most {hi})") from None
        if not math.isfinite(v) or v > hi or v < lo or (lo_open and v == lo):
            bound = f"more than {lo}" if lo_open else f"at least {lo}"
            raise _Bad(f"{value} is out of range ({bound}, at most {hi})")
        return v
    return check


def _choice(choices: tuple[str, ...]) -> Checker:
    def check(value: Any, _base: Path) -> str:
        if not isinstance(value, str):
            raise _Bad(f"must be a string, not {_type_name(value)} {_show(value)}")
        if value not in choices:
            raise _Bad(f"{_show(value)} is not one of: {', '.join(choices)}")
        return value
    return check


def _api_key_table(value: Any, _base: Path) -> dict[str, str]:
    """``[http.keys]``: API key -> tenant name, both non-empty strings."""
    if not isinstance(value, dict):
        raise _Bad(f"must be a table of KEY = TENANT, not {_type_name(value)}")
    if len(value) > 1024:
        raise _Bad("more than 1024 API keys")
    out: dict[str, str] = {}
    for key, tenant in value.items():
        if not key or len(key) > 512:
            raise _Bad("API keys must be 1..512 characters")
        if not isinstance(tenant, str) or not tenant:
            raise _Bad(f"the tenant bound to a key must be a non-empty string, "
                       f"not {_type_name(tenant)}")
        out[key] = tenant
    return out


def _str(value: Any, _base: Path) -> str:
    if not isinstance(value, str):
        raise _Bad(f"must be a string, not {_type_name(value)} {_show(value)}")
    return value


def _size(value: Any, _base: Path) -> int:
    try:
        return parse_size(value)
    except SizeError as exc:
        raise _Bad(str(exc)) from None


def _path(value: Any, base: Path) -> Path:
    if not isinstance(value, str | os.PathLike):
        raise _Bad(f"must be a path string, not {_type_name(value)} {_show(value)}")
    if str(value) == "":
        raise _Bad("must be a non-empty path")
    try:
        p = Path(value).expanduser()
    except RuntimeError as exc:  # "~nosuchuser/..."
        raise _Bad(f"{_show(value)}: {exc}") from None
    return p if p.is_absolute() else (base / p).absolute()


def _opt_path(value: Any, base: Path) -> Path | None:
    if isinstance(value, str) and value == "":
        return None
    return _path(value, base)


def _listen(value: Any, _base: Path) -> str:
    return check_listen_addr(value)


def _opt_peer(value: Any, _base: Path) -> str:
    if isinstance(value, str) and value == "":
        return ""
    return check_peer_addr(value)


def _addr_list(item: Callable[[Any], str]) -> Checker:
    def check(value: Any, _base: Path) -> list[str]:
        if isinstance(value, str):
            raise _Bad(f"must be a list of multiaddrs, e.g. [{_show(value)}]")
        if not isinstance(value, list | tuple):
            raise _Bad(f"must be a list of multiaddrs, not {_type_name(value)}")
        if len(value) > _MAX_ADDRS:
            raise _Bad(f"more than {_MAX_ADDRS} addresses")
        out: list[str] = []
        for i, v in enumerate(value):
            try:
                a = item(v)
            except _Bad as exc:
                raise _Bad(f"[{i}] {exc}") from None
            if a not in out:
                out.append(a)
        return out
    return check


def _http_addr(value: Any, _base: Path) -> str:
    if not isinstance(value, str):
        raise _Bad(f"must be a string HOST:PORT, not {_type_name(value)} {_show(value)}")
    if value == "":
        return ""
    host, port = _split_host_port(value)
    if host is None:
        raise _Bad(f'{_show(value)} is not HOST:PORT (e.g. "127.0.0.1:8080", "[::1]:8080")')
    return value


def _split_host_port(value: str) -> tuple[str | None, int]:
    m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d{1,5})|([^:\[\]\s]+):(\d{1,5})", value)
    if not m:
        return None, 0
    host = m.group(1) or m.group(3)
    port = int(m.group(2) or m.group(4))
    if port > 65535:
        return None, 0
    if m.group(1):
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return None, 0
    elif not (_HOST_RE.match(host) or _is_ipv4(host)):
        return None, 0
    return host, port


def _is_ipv4(host: str) -> bool:
    try:
        ipaddress.IPv4Address(host)
        return True
    except ValueError:
        return False


# --- sections ---------------------------------------------------------------------------


def _f(default: Any = dataclasses.MISSING, *, check: Checker, doc: str,
       factory: Callable[[], Any] | None = None, kind: str = "", secret: bool = False) -> Any:
    meta = {"check": check, "doc": doc, "kind": kind, "secret": secret}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class NodeSection:
    listen: str = _f(DEFAULT_LISTEN, check=_listen,
                     doc="libp2p listen multiaddr (/ip4|ip6/ADDR/tcp/PORT; port 0 = any)")
    advertise: list[str] = _f(check=_addr_list(_check_advertise_addr), factory=list,
                              doc="addresses to announce instead of listen (required for 0.0.0.0)")
    bootstrap: list[str] = _f(check=_addr_list(check_peer_addr), factory=list,
                              doc="peers to dial at start: /ip4|ip6|dns/HOST/tcp/PORT/p2p/PEER_ID")
    mdns: bool = _f(True, check=_bool, doc="discover peers on the local network (mDNS)")
    key_file: Path = _f(check=_path, factory=lambda: Path("keys/node.key").absolute(),
                        doc="node identity (created by `prefixmesh keygen`)", kind="path")
    cache_dir: Path = _f(check=_path, factory=default_cache_dir,
                         doc="where KV cache states are kept on disk", kind="path")
    ram_budget: int = _f(1024**3, check=_size, doc="KV cache budget in memory", kind="size")
    disk_budget: int = _f(8 * 1024**3, check=_size, doc="KV cache budget on disk", kind="size")
    kv_write_delay_s: float = _f(2.0, check=_float(0.0, 3600.0),
                                 doc="a new cached prefix is on disk within this many seconds "
                                     "(a crash loses at most that window)")
    log_level: str = _f("info", check=_choice(LOG_LEVELS), doc=" | ".join(LOG_LEVELS))
    log_format: str = _f("text", check=_choice(LOG_FORMATS),
                         doc="text | json (one JSON object per line)")


@dataclass
class ModelSection:
    path: Path | None = _f(None, check=_opt_path, kind="path",
                           doc="GGUF model file; absent = the embedded default (model fetch)")
    n_ctx: int = _f(4096, check=_int(128, 1 << 20), doc="context length in tokens")
    n_threads: int = _f(0, check=_int(0, 1024), doc="CPU threads (0 = llama.cpp default)")
    n_gpu_layers: int = _f(0, check=_int(-1, 10_000), doc="layers offloaded to a GPU (-1 = all)")
    # the KV cache's element types: q8_0 K stores 0.77x the bytes per token but changed
    # 30 of 50 greedy answers (docs/bench/engine.md), so f16 stays the default
    kv_type_k: str = _f("f16", check=_choice(tuple(KV_TYPES)),
                        doc="KV cache K type: " + " | ".join(KV_TYPES))
    kv_type_v: str = _f("f16", check=_choice(tuple(KV_TYPES)),
                        doc="KV cache V type (quantized V needs flash_attn)")
    flash_attn: bool = _f(False, check=_bool, doc="llama.cpp flash attention")
    live_sequence: bool = _f(False, check=_bool,
                             doc="keep the last prompt resident: its next turn restores nothing")
    batch_mode: str = _f("deterministic", check=_choice(BATCH_MODES),
                         doc="deterministic (bit-identical to a cold run) | throughput "
                             "(continuous batching)")


@dataclass
class DigestSection:
    interval_s: float = _f(_EXCHANGE.interval_s, check=_float(0.0, 3600.0, lo_open=True),
                           doc="seconds between anti-entropy exchanges")
    fanout: int = _f(_EXCHANGE.fanout, check=_int(1, 64), doc="peers contacted per exchange round")
    byte_budget: int = _f(_EXCHANGE.byte_budget, check=_size, kind="size",
                          doc="most record bytes sent per exchange")
    # at most overlay.digest.MAX_TTL_S: a longer-lived record would be refused by peers
    ttl_s: float = _f(900.0, check=_float(1.0, 3600.0), doc="lifetime of a digest record")
    refresh_interval_s: float = _f(300.0, check=_float(0.0, 86400.0, lo_open=True),
                                   doc="re-issue own record this often even without changes "
                                       "(capped at half the ttl; liveness and load are the "
                                       "membership's job)")
    bucket_summaries: bool = _f(_EXCHANGE.bucket_summaries, check=_bool,
                                doc="on a summary-hash mismatch answer with per-bucket hashes, "
                                    "so only differing buckets' entries are exchanged")
    compaction_ratio: float = _f(4.0, check=_float(0.0, 64.0, lo_open=True),
                                 doc="re-snapshot own record once deltas since the last "
                                     "snapshot exceed this x its size")
    min_record_interval_s: float = _f(0.0, check=_float(0.0, 3600.0),
                                      doc="issue at most one own digest delta per this many "
                                          "seconds, batching cache changes (0 = every tick "
                                          "with changes; capped at half the refresh interval)")
    partitions: int = _f(0, check=_int(0, 65536),
                         doc="partial replication: cached prefixes are spread over this many "
                             "partitions whose records live at `replicas` home nodes each; "
                             "0 = full replication (every node holds every record)")
    replicas: int = _f(3, check=_int(1, 16),
                       doc="home nodes per partition (used when partitions > 0)")
    partition_refresh_s: float = _f(300.0, check=_float(0.0, 86400.0, lo_open=True),
                                    doc="re-issue own partition records this often even "
                                        "without changes (partitions > 0; liveness is the "
                                        "heartbeat's job)")
    # at most overlay.digest.MAX_TTL_S: a longer-lived record would be refused by peers
    partition_ttl_s: float = _f(900.0, check=_float(1.0, 3600.0),
                                doc="lifetime of a partition record (partitions > 0; "
                                    "refresh is capped at half of it)")


@dataclass
class LimitsSection:
    peer_request_rate: float = _f(PEER_REQUEST_RATE, check=_float(0.0, 1e6, lo_open=True),
                                  doc="inference requests/s accepted from one peer (refill)")
    peer_request_burst: float = _f(PEER_REQUEST_BURST, check=_float(1.0, 1e7),
                                   doc="requests one peer may send at once (bucket size, >= 1)")
    max_peers_per_subnet: int = _f(MAX_PEERS_PER_SUBNET, check=_int(0, 1 << 16),
                                   doc="peers per IPv4 /24 or IPv6 /48 in one routing "
                                       "decision (0 = no cap)")
    max_inbound_per_subnet: int = _f(32, check=_int(0, 1 << 16),
                                     doc="peers per IPv4 /24 or IPv6 /48 connected to us "
                                         "inbound (loopback exempt; 0 = no cap)")
    digest_exchange_rate: float = _f(_EXCHANGE.exchange_rate_per_s, check=_float(0.0, 1e6, lo_open=True),
                                     doc="digest exchanges/s answered for one peer (refill)")
    digest_exchange_burst: float = _f(_EXCHANGE.exchange_burst, check=_float(1.0, 1e7),
                                      doc="digest exchanges one peer may open at once (>= 1)")


@dataclass
class RoutingSection:
    policy: str = _f("prefixmesh", check=_choice(POLICY_NAMES), doc=" | ".join(POLICY_NAMES))
    deadline_s: float = _f(60.0, check=_float(0.0, 3600.0, lo_open=True),
                           doc="default request deadline")
    hop_budget: int = _f(2, check=_int(0, 16), doc="most forwarding hops per request")
    # off by default: in swarms of 2-3 nodes the cap halves legitimate forwarding
    share_cap: bool = _f(False, check=_bool,
                         doc="no peer gets more than half of this node's last 100 forwards "
                             "(overlay/core/limits.py ForwardShareLimiter)")
    spot_check_fraction: float = _f(0.0, check=_float(0.0, 1.0),
                                    doc="re-execute this fraction of forwarded greedy answers "
                                        "here and compare (0 = off; overlay/core/trust.py)")
    # RoutingConfig overrides; filled from the keys of [routing] that are RoutingConfig fields
    knobs: dict[str, Any] = field(default_factory=dict, metadata={"knobs": True})

    def routing_config(self) -> Any:
        """An ``overlay.routing.RoutingConfig`` with this section's knobs applied."""
        from prefixmesh.overlay.core.routing import RoutingConfig

        return RoutingConfig(**self.knobs)


@dataclass
class HttpSection:
    listen: str = _f("", check=_http_addr, doc='HTTP gateway HOST:PORT ("" = off)')
    api_key: str = _f("", check=_str, secret=True,
                      doc="required as a Bearer token when set; required off loopback")
    keys: dict = _f(None, check=_api_key_table, secret=True, factory=dict,
                    doc="[http.keys] KEY = TENANT: API keys bound to one tenant each")


@dataclass
class MetricsSection:
    listen: str = _f("", check=_http_addr,
                     doc='HOST:PORT of /metrics and the dashboard alone ("" = off; node/metrics.py)')


@dataclass
class NatSection:
    relay_service: bool = _f(True, check=_bool,
                             doc="offer a bounded circuit relay to nodes behind NAT when publicly reachable")
    hole_punching: bool = _f(True, check=_bool,
                             doc="upgrade relayed links to direct ones (DCUtR) where both NATs allow it")
    upnp: bool = _f(False, check=_bool,
                    doc="ask the home router for a port mapping (UPnP IGD), where it offers one")


@dataclass
class ClientSection:
    peer: str = _f("", check=_opt_peer,
                   doc="node the CLI client talks to (multiaddr with /p2p/PEER_ID)")
    tenant: str = _f("public", check=_str, doc="tenant of requests ([tenants.NAME])")
    max_tokens: int = _f(512, check=_int(1, 1 << 20), doc="answer length limit")
    timeout_s: float = _f(60.0, check=_float(0.0, 3600.0, lo_open=True),
                          doc="give up on an answer after this many seconds")


_SECTIONS: dict[str, type] = {
    "node": NodeSection,
    "model": ModelSection,
    "digest": DigestSection,
    "routing": RoutingSection,
    "limits": LimitsSection,
    "http": HttpSection,
    "metrics": MetricsSection,
    "nat": NatSection,
    "client": ClientSection,
}


@dataclass
class Config:
    node: NodeSection = field(default_factory=NodeSection)
    model: ModelSection = field(default_factory=ModelSection)
    digest: DigestSection = field(default_factory=DigestSection)
    routing: RoutingSection = field(default_factory=RoutingSection)
    limits: LimitsSection = field(default_factory=LimitsSection)
    http: HttpSection = field(default_factory=HttpSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    nat: NatSection = field(default_factory=NatSection)
    client: ClientSection = field(default_factory=ClientSection)
    tenants: dict[str, TenantSpec] = field(default_factory=dict)
    source: Path | None = field(default=None, compare=False)

    def tenant_specs(self) -> tuple[TenantSpec, ...]:
        """Configured tenants, or the default public namespace when none are."""
        return tuple(self.tenants.values()) or default_tenant_specs()

    def tenant(self, name: str) -> TenantSpec | None:
        for spec in self.tenant_specs():
            if spec.name == name:
                return spec
        return None


# --- flags ------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlagSpec:
    """One ``prefixmesh node`` flag and the config key it sets."""

    flags: tuple[str, ...]
    key: str  # "section.key"
    help: str
    metavar: str | None = None
    action: str = "store"  # "store" | "append" | "bool" (--x / --no-x) | "count"


NODE_FLAGS: tuple[FlagSpec, ...] = (
    FlagSpec(("--listen",), "node.listen", "listen multiaddr", "MULTIADDR"),
    FlagSpec(("--advertise",), "node.advertise", "address to announce (repeatable)",
             "MULTIADDR", "append"),
    FlagSpec(("--bootstrap",), "node.bootstrap", "peer to dial at start (repeatable)",
             "MULTIADDR", "append"),
    FlagSpec(("--mdns",), "node.mdns", "LAN discovery on/off", None, "bool"),
    FlagSpec(("--key-file",), "node.key_file", "identity key file", "PATH"),
    FlagSpec(("--cache-dir",), "node.cache_dir", "KV cache directory", "DIR"),
    FlagSpec(("--ram-budget",), "node.ram_budget", "KV cache RAM budget (e.g. 2GiB)", "SIZE"),
    FlagSpec(("--disk-budget",), "node.disk_budget", "KV cache disk budget", "SIZE"),
    FlagSpec(("--model",), "model.path", "GGUF model file (default: embedded model)", "PATH"),
    FlagSpec(("--n-ctx",), "model.n_ctx", "context length", "N"),
    FlagSpec(("--n-threads",), "model.n_threads", "CPU threads (0 = default)", "N"),
    FlagSpec(("--n-gpu-layers",), "model.n_gpu_layers", "layers on the GPU (-1 = all)", "N"),
    FlagSpec(("--policy",), "routing.policy", "routing policy: " + ", ".join(POLICY_NAMES),
             "NAME"),
    FlagSpec(("--hop-budget",), "routing.hop_budget", "most forwarding hops", "N"),
    FlagSpec(("--http",), "http.listen", "HTTP gateway HOST:PORT (default off)", "ADDR"),
    FlagSpec(("--log-level",), "node.log_level", "log level: " + ", ".join(LOG_LEVELS),
             "LEVEL"),
    FlagSpec(("--log-format",), "node.log_format", "log format: text or json", "FORMAT"),
    FlagSpec(("-v", "--verbose"), "node.log_level", "more logging (-v: debug)", None, "count"),
)


# flags of the client commands (chat, ask, peers) that set [client] keys
CLIENT_FLAGS = {"client.peer": "--peer", "client.tenant": "--tenant",
                "client.max_tokens": "--max-tokens", "client.timeout_s": "--timeout"}


def flag_label(key: str) -> str:
    """The command-line flag that sets ``key`` ("node.listen" -> "--listen")."""
    for spec in NODE_FLAGS:
        if spec.key == key:
            return spec.flags[-1]
    return CLIENT_FLAGS.get(key, key)


# --- loading ----------------------------------------------------------------------------


def _routing_knob_fields() -> dict[str, Any] | None:
    """RoutingConfig field -> default, or None if the routing module is not there."""
    try:
        from prefixmesh.overlay.core.routing import RoutingConfig
    except ImportError:
        return None
    out: dict[str, Any] = {}
    for f in dataclasses.fields(RoutingConfig):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _check_knob(value: Any, default: Any) -> Any:
    if isinstance(default, bool):
        return _bool(value, Path())
    if isinstance(default, int):
        return _int(-(1 << 62), 1 << 62)(value, Path())
    if isinstance(default, float):
        return _float(-1e300, 1e300)(value, Path())
    if isinstance(default, str):
        return _str(value, Path())
    raise _Bad("cannot be set from a config file")


def _load_section(cls: type, name: str, table: Any, base: Path) -> Any:
    if not isinstance(table, dict):
        raise ConfigError(f"[{name}]", f"must be a table, not {_type_name(table)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if "check" in f.metadata}
    values: dict[str, Any] = {}
    knobs: dict[str, Any] = {}
    knob_fields = _routing_knob_fields() if cls is RoutingSection else None
    for key, raw in table.items():
        if key in fields:
            try:
                values[key] = fields[key].metadata["check"](raw, base)
            except _Bad as exc:
                raise ConfigError(f"[{name}].{key}", str(exc)) from None
        elif knob_fields is not None and key in knob_fields:
            try:
                knobs[key] = _check_knob(raw, knob_fields[key])
            except _Bad as exc:
                raise ConfigError(f"[{name}].{key}", str(exc)) from None
        else:
            known = list(fields) + sorted(knob_fields or ())
            raise ConfigError(f"[{name}].{key}",
                              f"unknown key (known: {', '.join(known)})")
    obj = cls(**values)
    if knobs:
        obj.knobs.update(knobs)
    return obj


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            content = fh.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError("", f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError("", f"{path}: is a directory, not a config file") from None
    except OSError as exc:
        raise ConfigError("", f"{path}: cannot read config file ({exc.strerror})") from None
    if len(content) > MAX_CONFIG_BYTES:
        raise ConfigError("", f"{path}: config file larger than {MAX_CONFIG_BYTES} bytes")
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError("", f"{path}: config file is not UTF-8") from None
    return _parse_toml(text, f"{path}: ")


def _parse_toml(text: str, where: str = "") -> dict[str, Any]:
    """tomllib with every failure as a ConfigError.

    tomllib recurses per nesting level (a hostile file of nested arrays raises
    RecursionError) and int() refuses literals over 4,300 digits (ValueError).
    """
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("", f"{where}invalid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError("", f"{where}invalid TOML: nested too deeply") from None
    except ValueError as exc:  # e.g. an integer literal beyond int()'s digit limit
        raise ConfigError("", f"{where}invalid TOML: {exc}") from None


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    text: str | None = None,
) -> Config:
    """The effective configuration: defaults < file (``path`` or TOML ``text``) < overrides.

    ``overrides`` maps ``"section.key"`` to a raw value (as given on the command line, or
    ``None`` for "not given"); an error in one names its flag (:data:`NODE_FLAGS`).
    Raises :class:`ConfigError`.
    """
    doc: dict[str, Any] = {}
    base = Path.cwd()
    source: Path | None = None
    if text is not None:
        doc = _parse_toml(text)
    elif path is not None:
        source = Path(path).expanduser().absolute()
        doc = _read_toml(source)
        base = source.parent

    sections: dict[str, Any] = {}
    tenants: dict[str, TenantSpec] = {}
    for name, table in doc.items():
        if name in _SECTIONS:
            sections[name] = _load_section(_SECTIONS[name], name, table, base)
        elif name == "tenants":
            if not isinstance(table, dict):
                raise ConfigError("[tenants]", "must be a table of [tenants.NAME] tables")
            for tname, ttable in table.items():
                try:
                    tenants[tname] = parse_tenant(tname, ttable, base_dir=base)
                except TenantConfigError as exc:
                    raise ConfigError("", str(exc)) from None
        else:
            known = ", ".join([*_SECTIONS, "tenants"])
            raise ConfigError(f"[{name}]", f"unknown section (known: {known})")
    cfg = Config(**{k: sections.get(k, cls()) for k, cls in _SECTIONS.items()},
                 tenants=tenants, source=source)
    given = {k for k, v in (overrides or {}).items() if v is not None}
    if overrides:
        _apply_overrides(cfg, overrides)
    _check_cross(cfg, lambda key: flag_label(key) if key in given else
                 "[{}].{}".format(*key.split(".", 1)))
    return cfg


def _apply_overrides(cfg: Config, overrides: Mapping[str, Any]) -> None:
    cwd = Path.cwd()
    for key, raw in overrides.items():
        if raw is None:
            continue
        section_name, _, field_name = key.partition(".")
        section = getattr(cfg, section_name, None)
        fdefs = {f.name: f for f in dataclasses.fields(section)} if section is not None else {}
        if field_name not in fdefs or "check" not in fdefs[field_name].metadata:
            raise ConfigError(key, "no such configuration key")
        label = flag_label(key)
        if key == "node.log_level" and isinstance(raw, int) and not isinstance(raw, bool):
            if raw <= 0:
                continue
            raw = "debug"  # -v (a count)
        try:
            value = fdefs[field_name].metadata["check"](raw, cwd)
        except _Bad as exc:
            raise ConfigError(label, str(exc)) from None
        setattr(section, field_name, value)


def _check_cross(cfg: Config, where: Callable[[str], str]) -> None:
    """Checks that involve several keys; ``where(key)`` names a key or the flag that set it."""
    listen_host = parse_multiaddr(cfg.node.listen)[0][1]
    if _unspecified(listen_host) and not cfg.node.advertise:
        raise ConfigError(
            where("node.listen"),
            f'"{cfg.node.listen}" listens on every interface but peers cannot dial '
            f"{listen_host}; set [node].advertise (--advertise) to the address peers should "
            "use, or listen on a specific address",
        )
    if cfg.http.listen:
        host, _port = _split_host_port(cfg.http.listen)
        if host is not None and not is_loopback_host(host) and not (cfg.http.api_key or cfg.http.keys):
            raise ConfigError(
                where("http.listen"),
                f'"{cfg.http.listen}" is reachable from other machines; set [http].api_key '
                "or [http.keys]",
            )
    if cfg.metrics.listen:  # operator endpoints: only the unbound [http].api_key opens them
        host, _port = _split_host_port(cfg.metrics.listen)
        if host is not None and not is_loopback_host(host) and not cfg.http.api_key:
            raise ConfigError(where("metrics.listen"), f'"{cfg.metrics.listen}" is reachable '
                              "from other machines; set [http].api_key")
    for tenant in cfg.http.keys.values():
        if tenant != "public" and tenant not in cfg.tenants:
            raise ConfigError("[http.keys]", f'a key is bound to "{tenant}", which is not a '
                              "configured tenant")
    if cfg.routing.knobs:
        try:
            cfg.routing.routing_config()
        except ValueError as exc:  # InvalidRoutingConfig names the knob and the problem
            raise ConfigError("[routing]", str(exc)) from None
    if cfg.client.tenant != "public" and cfg.client.tenant not in cfg.tenants:
        hint = (f"add a [tenants.{cfg.client.tenant}] table to {cfg.source}" if cfg.source
                else f"pass --config FILE with a [tenants.{cfg.client.tenant}] table")
        raise ConfigError(where("client.tenant"),
                          f'"{cfg.client.tenant}" is not a configured tenant ({hint})')


# --- printing ---------------------------------------------------------------------------


def _toml_str(s: str) -> str:
    # JSON string escapes are valid TOML basic-string escapes (\" \\ \n \t \uXXXX)
    return json.dumps(s, ensure_ascii=False)


def _toml_value(value: Any, kind: str = "") -> str:
    if kind == "size":
        return _toml_str(format_size(value))
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, Path):
        return _toml_str(str(value))
    if isinstance(value, str):
        return _toml_str(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot print {type(value).__name__} as TOML")


def config_to_toml(cfg: Config) -> str:
    """The effective configuration as TOML; secrets are redacted (printed as comments)."""
    lines: list[str] = ["# prefixmesh effective configuration"]
    if cfg.source is not None:
        lines.append(f"# loaded from {cfg.source}")
    for name in _SECTIONS:
        section = getattr(cfg, name)
        lines += ["", f"[{name}]"]
        for f in dataclasses.fields(section):
            if "check" not in f.metadata:
                continue
            value = getattr(section, f.name)
            doc = f.metadata["doc"]
            if value is None:
                lines.append(f"# {f.name} = ...  # {doc}")
                continue
            if f.metadata["secret"] and value:
                lines.append(f"# {f.name} = {_REDACTED}  # {doc}")
                continue
            if isinstance(value, dict):  # a sub-table such as [http.keys]; empty here
                lines.append(f"# {f.name}: none  # {doc}")
                continue
            lines.append(f"{f.name} = {_toml_value(value, f.metadata['kind'])}  # {doc}")
        if isinstance(section, RoutingSection):
            knob_defaults = _routing_knob_fields() or {}
            for knob, default in knob_defaults.items():
                if knob in section.knobs:
                    lines.append(f"{knob} = {_toml_value(section.knobs[knob])}  "
                                 f"# RoutingConfig.{knob}")
                elif isinstance(default, bool | int | float | str):
                    lines.append(f"# {knob} = {_toml_value(default)}  # RoutingConfig default")
    for spec in cfg.tenants.values():
        lines += ["", f"[tenants.{spec.name}]", f"visibility = {_toml_str(spec.visibility)}"]
        if spec.secret_source == "file":
            lines.append(f"secret_file = {_toml_str(str(spec.secret_file))}")
        elif spec.secret_source == "inline":
            lines.append(f"# secret = {_REDACTED}")
        if spec.allowed_peers:
            from prefixmesh.overlay.core.identity import peer_id_to_b58

            lines.append("allowed_peers = "
                         + _toml_value([peer_id_to_b58(p) for p in spec.allowed_peers]))
    if not cfg.tenants:
        lines += ["", "# no [tenants.NAME] tables: the public namespace \"public\" is used"]
    return "\n".join(lines) + "\n"


__all__ += ["flag_label", "CLIENT_FLAGS", "SIZE_HINT"]

