"""node/process.py: a node's identity and engine backend, built from its config before
the overlay exists (the launcher and the daemon share these)."""

from __future__ import annotations

import logging

from prefixmesh.inference.backend import SimulatedBackend
from prefixmesh.node.config import load_config
from prefixmesh.node.process import NodeOptions, load_or_create_identity, make_backend


def test_a_missing_key_file_becomes_a_new_identity_once_and_says_so(tmp_path, caplog):
    path = tmp_path / "keys" / "node.key"
    with caplog.at_level(logging.WARNING, logger="prefixmesh.node"):
        first = load_or_create_identity(path)
        again = load_or_create_identity(path)
    assert path.is_file() and again.peer_id == first.peer_id
    warned = [r.getMessage() for r in caplog.records if "no key file" in r.getMessage()]
    assert len(warned) == 1 and first.peer_id_b58 in warned[0]


def test_the_simulated_backend_takes_its_capacity_from_the_ram_budget(tmp_path):
    cfg = load_config(None, {"node.ram_budget": "3MiB", "node.cache_dir": str(tmp_path)})
    backend = make_backend(cfg, NodeOptions(backend="sim", sim_prefill_tps=100.0))
    assert isinstance(backend, SimulatedBackend)
    assert backend.load_figures().kv_capacity_bytes == 3 << 20
    assert backend.load_began is None
    backend.begin_load()  # nothing to load: a no-op the launcher may call
