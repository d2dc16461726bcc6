"""bench/node_entry.py: a benchmark's node starts from its config file like ``prefixmesh
node --config FILE``, plus harness switches; it may run a baseline policy, which the
node's own config refuses."""

from __future__ import annotations

import random
import tomllib

from prefixmesh.bench import node_entry
from prefixmesh.bench.policies import PaperPolicy
from prefixmesh.node import daemon, launch
from prefixmesh.overlay.core.routing import RoutingConfig


def _capture(monkeypatch) -> dict:
    seen: dict = {}
    monkeypatch.setattr(launch, "run_node",
                        lambda config, options: seen.update(config=config, options=options) or 0)
    monkeypatch.setattr(daemon, "make_policy", daemon.make_policy)  # undone after the test
    return seen


def test_the_config_file_and_harness_switches_reach_run_node(monkeypatch, tmp_path):
    seen = _capture(monkeypatch)
    cfg = node_entry.write_config(tmp_path / "n.toml", {
        "node": {"listen": "/ip4/127.0.0.1/tcp/0", "mdns": False},
        "routing": {"share_cap": True, "spot_check_fraction": 0.25},
    })
    assert node_entry.main(["--config", str(cfg), "--backend", "sim", "--sim-prefill-tps",
                            "300", "--no-dht", "--seed", "7"]) == 0
    config, options = seen["config"], seen["options"]
    assert config.source == cfg and config.node.mdns is False
    assert config.routing.share_cap is True and config.routing.spot_check_fraction == 0.25
    assert (options.backend, options.sim_prefill_tps, options.dht, options.digest,
            options.seed) == ("sim", 300.0, False, True, 7)


def test_a_baseline_policy_reaches_the_daemon_through_the_bench_entry(monkeypatch, tmp_path):
    seen = _capture(monkeypatch)
    cfg = node_entry.write_config(tmp_path / "n.toml", {"node": {"mdns": False}})
    assert node_entry.main(["--config", str(cfg), "--policy", "paper"]) == 0
    assert seen["config"].routing.policy == "prefixmesh"  # the config is untouched ...
    # ... and the factory builds the baseline
    policy = daemon.make_policy("prefixmesh", RoutingConfig(), random.Random(0), b"me")
    assert isinstance(policy, PaperPolicy)


def test_an_unknown_policy_or_a_bad_config_is_refused(capsys, monkeypatch, tmp_path):
    _capture(monkeypatch)
    cfg = node_entry.write_config(tmp_path / "n.toml", {"routing": {"spot_check_fraction": 2}})
    assert node_entry.main(["--config", str(cfg), "--policy", "no-such"]) == 2
    assert "--policy needs one of" in capsys.readouterr().err
    assert node_entry.main(["--config", str(cfg)]) == 2
    assert "[routing].spot_check_fraction" in capsys.readouterr().err


def test_config_toml_loads_back():
    tables = {"node": {"listen": "/ip4/127.0.0.1/tcp/0", "bootstrap": ["a", "b"],
                       "mdns": False, "ram_budget": "64MiB"},
              "digest": {"interval_s": 0.5},
              "http": {"listen": "", "keys": {"a key \"q\"": "team"}},
              "tenants": {"team": {"secret": "s\u00e9cret\n"}}}
    assert tomllib.loads(node_entry.config_toml(tables)) == tables
