"""Benchmark node entry point: ``python -m prefixmesh.bench.node_entry --config FILE [...]``.

Starts a node the way ``prefixmesh node --config FILE`` does (``load_config`` then the
launcher's ``run_node``, ``node/launch.py``): every node setting comes from the config file. The flags here are
the harness switches that are not operator settings (``node.process.NodeOptions``):

- ``--policy NAME`` may also name a baseline of ``bench/policies.py`` (``paper``,
  ``round-robin``, ...), which the node's own config refuses: the daemon's policy
  factory builds the named one instead;
- ``--backend sim`` with ``--sim-prefill-tps`` / ``--sim-decode-tps``: the simulated
  engine (no model);
- ``--no-digest``, ``--no-dht``, ``--seed N`` (gossip peer choice, spot-check draws);
- ``--link-delay-ms D``: delays every frame the process sends by D ms
  (``overlay.host.set_link_delay``; ``prefixmesh bench swarm`` uses it where the kernel
  has no netem).

``bench/swarm.py``, ``bench/overlay.py`` and ``bench/attack_digest_flood.py`` start their
nodes through this file; the test entry point ``tests/_fault_node.py`` wraps it.
:func:`config_toml` / :func:`write_config` write a node's config file from tables.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prefixmesh.node import daemon, launch, process

from .policies import POLICY_NAMES, make_policy

__all__ = ["build_parser", "main", "config_toml", "write_config"]

log = logging.getLogger("prefixmesh.node")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m prefixmesh.bench.node_entry",
                                description="run a prefixmesh node for a benchmark or test")
    p.add_argument("--config", required=True, help="the node's TOML config file")
    p.add_argument("--policy", help="routing policy, baselines included: "
                   + ", ".join(POLICY_NAMES))
    p.add_argument("--backend", choices=("llama", "sim"), default="llama")
    p.add_argument("--sim-prefill-tps", type=float, default=0.0)
    p.add_argument("--sim-decode-tps", type=float, default=0.0)
    p.add_argument("--no-digest", action="store_true")
    p.add_argument("--no-dht", action="store_true")
    p.add_argument("--seed", type=int)
    p.add_argument("--membership", choices=("heartbeat", "swim"), default="swim",
                   help="who is up: SWIM (the node's default) or the all-to-all heartbeat "
                        "(the measured baseline, for comparisons)")
    p.add_argument("--link-delay-ms", type=float, default=0.0,
                   help="benchmark-only delay of every frame sent (0-10,000 ms)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from prefixmesh.node.config import ConfigError, load_config
    from prefixmesh.overlay.host import set_link_delay

    a = build_parser().parse_args(argv)
    if a.policy is not None:
        if a.policy not in POLICY_NAMES:
            print(f"node_entry: --policy needs one of {', '.join(POLICY_NAMES)}",
                  file=sys.stderr)
            return 2
        name = a.policy
        daemon.make_policy = lambda _name, config, rng, self_id: make_policy(
            name, config, rng, self_id)
    try:
        config = load_config(a.config)
    except ConfigError as exc:
        print(f"node_entry: config error: {exc}", file=sys.stderr)
        return 2
    if a.link_delay_ms:
        try:
            set_link_delay(a.link_delay_ms / 1000.0)
        except ValueError as exc:
            print(f"node_entry: --link-delay-ms: {exc}", file=sys.stderr)
            return 2
        log.warning("BENCHMARK-ONLY LINK DELAY ACTIVE: %g ms per frame sent", a.link_delay_ms)
    options = process.NodeOptions(digest=not a.no_digest, dht=not a.no_dht, backend=a.backend,
                                 sim_prefill_tps=a.sim_prefill_tps,
                                 sim_decode_tps=a.sim_decode_tps, seed=a.seed,
                                 membership=a.membership)
    with contextlib.suppress(KeyboardInterrupt):
        return launch.run_node(config, options)
    return 130


# --- config files -------------------------------------------------------------------------

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _key(k: str) -> str:
    return k if _BARE_KEY.fullmatch(k) else json.dumps(k, ensure_ascii=False)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str | Path):
        return json.dumps(str(v), ensure_ascii=False)  # JSON escapes are TOML escapes
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to a config file")


def config_toml(tables: Mapping[str, Any], _prefix: str = "") -> str:
    """TOML text of nested tables (``{"node": {"listen": ...}, "tenants": {"t": {...}}}``)."""
    subs = {k: v for k, v in tables.items() if isinstance(v, Mapping)}
    lines = [f"{_key(k)} = {_value(v)}" for k, v in tables.items() if k not in subs]
    if _prefix and (lines or not subs):
        lines.insert(0, f"[{_prefix}]")
    out = "\n".join(lines) + "\n" if lines else ""
    for k, v in subs.items():
        out += "\n" + config_toml(v, f"{_prefix}.{_key(k)}" if _prefix else _key(k))
    return out


def write_config(path: Path, tables: Mapping[str, Any]) -> Path:
    """Write ``tables`` as the TOML config file ``path``; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config_toml(tables))
    return path


if __name__ == "__main__":
    raise SystemExit(main())
