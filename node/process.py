"""What a node process is made of before its overlay, shared by the launcher
(``node/launch.py``, which builds them before it imports the overlay) and the daemon
(``node/daemon.py``, which builds them itself when a test constructs a ``Node`` directly):
the harness switches, the identity, the engine backend, and the immediate exit.

No libp2p here (``tests/node/test_launch.py`` checks it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from prefixmesh.inference.backend import Backend, LlamaBackend, SimulatedBackend
from prefixmesh.overlay.core.identity import Identity, KeyFileNotFound
from prefixmesh.overlay.keyfile import load_identity, save_identity

__all__ = ["NodeOptions", "exit_now", "load_or_create_identity", "make_backend"]

log = logging.getLogger("prefixmesh.node")


@dataclass
class NodeOptions:
    """Harness switches of tests and benchmarks, not operator settings (those are all in
    the config file, ``node/config.py``); ``prefixmesh node`` uses the defaults."""

    digest: bool = True  # run the digest exchange (off: no peer knows our cache)
    dht: bool = True  # Kademlia DHT discovery
    backend: str = "llama"  # "llama" | "sim"
    sim_prefill_tps: float = 0.0
    sim_decode_tps: float = 0.0
    # who is up: "swim" (overlay/swim.py, O(1) messages per node per period; the default)
    # or "heartbeat" (all-to-all pings, overlay/heartbeat.py: the measured baseline,
    # ``node_entry --membership heartbeat``); docs/SCALING.md. The interval/timeout are
    # the heartbeat's.
    membership: str = "swim"
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 1.5
    print_addrs: bool = True
    seed: int | None = None  # gossip peer choice and spot-check draws (None: random)


def exit_now(status: int, why: str, level: int = logging.WARNING) -> None:
    """Leave the process immediately (no cleanup can hang it), after saying why."""
    with contextlib.suppress(Exception):
        log.log(level, "%s", why)
        sys.stderr.flush()
        sys.stdout.flush()
    os._exit(status)


def load_or_create_identity(path: Path) -> Identity:
    try:
        return load_identity(path)
    except KeyFileNotFound:
        identity = Identity.generate()
        save_identity(identity, path)
        # never silent: a key file that went missing means this node is someone new now
        log.warning("no key file at %s: created a new identity there, peer id %s "
                    "(keep the file to keep this identity)", path, identity.peer_id_b58)
        return identity


def make_backend(config, options: NodeOptions) -> Backend:
    if options.backend == "sim":
        return SimulatedBackend(
            prefill_tps=options.sim_prefill_tps,
            decode_tps=options.sim_decode_tps,
            capacity_bytes=config.node.ram_budget,
        )
    from prefixmesh.inference.model import resolve_model

    return LlamaBackend(
        # the default model is fetched here with pip's progress on stderr (a first start
        # downloads 93 MB: silence would look like a hang)
        model_path=config.model.path or resolve_model(None, progress=True),
        n_ctx=config.model.n_ctx,
        n_threads=config.model.n_threads or None,
        n_gpu_layers=config.model.n_gpu_layers,
        kv_dir=config.node.cache_dir,
        ram_budget_bytes=config.node.ram_budget,
        disk_budget_bytes=config.node.disk_budget,
        write_delay_s=config.node.kv_write_delay_s,
        type_k=config.model.kv_type_k,
        type_v=config.model.kv_type_v,
        flash_attn=config.model.flash_attn,
        live_sequence=config.model.live_sequence,
        batch_mode=config.model.batch_mode,
    )
