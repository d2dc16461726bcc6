"""node/config.py: validation errors, defaults, flags, --print-config. (The size grammar,
node/sizes.py, is tests/node/test_sizes.py.)"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest

from prefixmesh.node.config import (
    DEFAULT_LISTEN,
    NODE_FLAGS,
    POLICY_NAMES,
    Config,
    ConfigError,
    config_to_toml,
    load_config,
)
from prefixmesh.overlay.core.identity import Identity

REPO = Path(__file__).resolve().parents[2]
PEER = Identity.from_seed(bytes(range(32))).peer_id_b58
BOOT = f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER}"


def write(tmp_path: Path, text: str, name: str = "node.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def err(tmp_path: Path, text: str, overrides: dict | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), overrides)
    return str(info.value)


# --- defaults and examples --------------------------------------------------------------


def test_defaults():
    cfg = load_config()
    assert cfg.node.listen == DEFAULT_LISTEN
    assert cfg.node.bootstrap == []
    assert cfg.node.key_file == Path("keys/node.key").absolute()
    assert cfg.model.path is None
    assert cfg.digest.interval_s == 1.0
    assert cfg.http.listen == ""
    assert [t.name for t in cfg.tenant_specs()] == ["public"]
    assert cfg.tenant_specs()[0].visibility == "public"


def test_policy_names_are_the_deployable_ones(tmp_path):
    from prefixmesh.overlay.core import routing

    assert POLICY_NAMES == routing.DEPLOYABLE_POLICIES
    # the baselines are for the simulator and benchmarks (bench/policies.py), not a node
    for name in ("oracle", "paper", "round-robin"):
        with pytest.raises(ConfigError, match="policy"):
            load_config(None, {"routing.policy": name})


def test_every_node_flag_has_a_config_key():
    cfg = Config()
    for spec in NODE_FLAGS:
        section, _, key = spec.key.partition(".")
        assert hasattr(getattr(cfg, section), key), spec.key


def test_example_configs_load(tmp_path, monkeypatch):
    volunteer = load_config(REPO / "examples" / "volunteer-node.toml")
    assert volunteer.node.bootstrap  # the example shows a bootstrap peer
    # the tenants example refers to a secret file next to it; give it a real one
    examples = tmp_path / "examples"
    examples.mkdir()
    text = (REPO / "examples" / "tenants.toml").read_text()
    (examples / "tenants.toml").write_text(text)
    secret_name = tomllib.loads(text)["tenants"]["acme"]["secret_file"]
    secret = examples / secret_name
    secret.parent.mkdir(parents=True, exist_ok=True)
    secret.write_text("s" * 40 + "\n")
    secret.chmod(0o600)
    cfg = load_config(examples / "tenants.toml")
    vis = {name: t.visibility for name, t in cfg.tenants.items()}
    assert "private" in vis.values() and "public" in vis.values()
    assert cfg.tenants["acme"].secret == b"s" * 40


# --- error paths ------------------------------------------------------------------------


def test_unknown_key(tmp_path):
    msg = err(tmp_path, "[node]\nlisten_addr = '/ip4/127.0.0.1/tcp/0'\n")
    assert msg.startswith("[node].listen_addr: unknown key")
    assert "listen" in msg


def test_unknown_section(tmp_path):
    assert err(tmp_path, "[nodes]\n").startswith("[nodes]: unknown section")


def test_unknown_routing_knob(tmp_path):
    assert "[routing].margin: unknown key" in err(tmp_path, "[routing]\nmargin = 1.0\n")


def test_routing_knobs_validated_and_applied(tmp_path):
    cfg = load_config(write(tmp_path, "[routing]\nmargin_s = 0.2\nmax_fallbacks = 1\n"))
    rc = cfg.routing.routing_config()
    assert rc.margin_s == 0.2 and rc.max_fallbacks == 1
    assert "[routing]" in err(tmp_path, "[routing]\nmargin_frac = 1.5\n")
    assert "[routing].max_fallbacks: must be an integer" in err(
        tmp_path, "[routing]\nmax_fallbacks = 'two'\n"
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[node]\nmdns = 'yes'\n", '[node].mdns: must be true or false, not a string "yes"'),
        ("[model]\nn_ctx = 4096.0\n", "[model].n_ctx: must be an integer, not a float"),
        ("[model]\nn_ctx = 12\n", "[model].n_ctx: 12 is out of range"),
        ("[node]\nbootstrap = '" + BOOT + "'\n", "[node].bootstrap: must be a list"),
        ("[digest]\ninterval_s = 0\n", "[digest].interval_s: 0 is out of range"),
        ("[routing]\npolicy = 'fastest'\n", '[routing].policy: "fastest" is not one of'),
        ("[node]\nlog_level = 'loud'\n", "[node].log_level"),
        ("node = 3\n", "[node]: must be a table"),
        ("[http]\nlisten = 'localhost'\n", '[http].listen: "localhost" is not HOST:PORT'),
    ],
)
def test_wrong_types_and_values(tmp_path, text, expected):
    assert expected in err(tmp_path, text)


def test_budget_not_a_size(tmp_path):
    msg = err(tmp_path, '[node]\nram_budget = "12 parsecs"\n')
    assert msg == '[node].ram_budget: "12 parsecs" is not a size (use e.g. 512MiB, 2GB)'


def test_budget_sizes(tmp_path):
    cfg = load_config(write(tmp_path, '[node]\nram_budget = "1.5 GiB"\ndisk_budget = 1000\n'))
    assert cfg.node.ram_budget == 3 * 1024**3 // 2
    assert cfg.node.disk_budget == 1000


@pytest.mark.parametrize(
    ("addr", "problem"),
    [
        ("/ip4/127.0.0.1/tcp/4001", "lacks the peer id"),
        ("/ip4/127.0.0.1/tcp/4001/p2p/QmNotAPeer", "is not a peer id"),
        ("/ip4/300.0.0.1/tcp/4001/p2p/" + PEER, "'300.0.0.1' is not an IPv4 address"),
        ("/ip4/127.0.0.1/tcp/99999/p2p/" + PEER, "'99999' is not a TCP port"),
        ("/ip4/127.0.0.1/udp/4001/p2p/" + PEER, "unsupported protocol 'udp'"),
        ("ip4/127.0.0.1/tcp/4001/p2p/" + PEER, "starts with '/'"),
        ("/ip4/127.0.0.1/tcp/0/p2p/" + PEER, "not dialable"),
        ("/dns/-bad-/tcp/4001/p2p/" + PEER, "is not a host name"),
        ("/tcp/4001/ip4/127.0.0.1/p2p/" + PEER, "wrong shape"),
        ("/ip4/127.0.0.1/tcp", "/tcp needs a value"),
    ],
)
def test_bad_bootstrap_multiaddr(tmp_path, addr, problem):
    msg = err(tmp_path, f'[node]\nbootstrap = ["{addr}"]\n')
    assert msg.startswith("[node].bootstrap: [0] ")
    assert problem in msg


def test_good_bootstrap_multiaddrs(tmp_path):
    addrs = [BOOT, f"/dns/boot.example.org/tcp/4001/p2p/{PEER}", f"/ip6/::1/tcp/4001/p2p/{PEER}"]
    cfg = load_config(write(tmp_path, f"[node]\nbootstrap = {addrs!r}\n".replace("'", '"')))
    assert cfg.node.bootstrap == addrs


def test_listen_rejects_p2p_and_dns(tmp_path):
    assert "no /p2p part" in err(tmp_path, f'[node]\nlisten = "{BOOT}"\n')
    assert "wrong shape" in err(tmp_path, '[node]\nlisten = "/dns/example.org/tcp/1"\n')


def test_listen_unspecified_needs_advertise(tmp_path):
    msg = err(tmp_path, '[node]\nlisten = "/ip4/0.0.0.0/tcp/4001"\n')
    assert msg.startswith("[node].listen:") and "advertise" in msg
    assert "advertise" in err(tmp_path, '[node]\nlisten = "/ip6/::/tcp/4001"\n')
    cfg = load_config(write(
        tmp_path,
        '[node]\nlisten = "/ip4/0.0.0.0/tcp/4001"\nadvertise = ["/ip4/192.0.2.7/tcp/4001"]\n',
    ))
    assert cfg.node.advertise == ["/ip4/192.0.2.7/tcp/4001"]


def test_http_off_loopback_needs_api_key(tmp_path):
    msg = err(tmp_path, '[http]\nlisten = "0.0.0.0:8080"\n')
    assert msg.startswith("[http].listen:") and "api_key" in msg
    cfg = load_config(write(tmp_path, '[http]\nlisten = "0.0.0.0:8080"\napi_key = "k" \n'))
    assert cfg.http.api_key == "k"
    assert load_config(write(tmp_path, '[http]\nlisten = "[::1]:8080"\n')).http.listen


def test_invalid_toml_and_missing_file(tmp_path):
    msg = err(tmp_path, "[node\n")
    assert "invalid TOML" in msg and "node.toml" in msg
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


def test_unreadable_config_file(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads files regardless of their mode")
    p = write(tmp_path, "[node]\n")
    p.chmod(0)
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(p)


def test_tenant_errors_name_the_key(tmp_path):
    assert err(tmp_path, "[tenants.acme]\nvisibility = 'secretive'\nsecret = '" + "x" * 20 + "'\n"
               ).startswith('[tenants.acme].visibility: "secretive" is not one of')
    assert err(tmp_path, "[tenants.acme]\nscret = 'x'\n").startswith("[tenants.acme].scret: unknown")
    assert "secret_file" in err(tmp_path, "[tenants.acme]\nsecret_file = 'missing.key'\n")


def test_relative_paths_resolve_against_the_config_file(tmp_path):
    sub = tmp_path / "conf"
    sub.mkdir()
    cfg = load_config(write(sub, '[node]\nkey_file = "k/node.key"\ncache_dir = "kv"\n'))
    assert cfg.node.key_file == sub / "k" / "node.key"
    assert cfg.node.cache_dir == sub / "kv"


# --- flags ------------------------------------------------------------------------------


def test_flags_override_file(tmp_path):
    p = write(tmp_path, f'[node]\nram_budget = "1GiB"\nmdns = true\nbootstrap = ["{BOOT}"]\n'
                        "[model]\nn_gpu_layers = 4\n")
    cfg = load_config(p, {"node.ram_budget": "2GiB", "node.mdns": False,
                          "model.n_gpu_layers": "-1", "node.bootstrap": None,
                          "node.log_level": 1})
    assert cfg.node.ram_budget == 2 * 1024**3
    assert cfg.node.mdns is False
    assert cfg.model.n_gpu_layers == -1
    assert cfg.node.bootstrap == [BOOT]  # None = flag not given
    assert cfg.node.log_level == "debug"


def test_bad_flag_value_names_the_flag(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(None, {"node.ram_budget": "12 parsecs"})
    assert str(info.value) == '--ram-budget: "12 parsecs" is not a size (use e.g. 512MiB, 2GB)'
    with pytest.raises(ConfigError, match="^--listen: "):
        load_config(None, {"node.listen": "/ip4/1.2.3/tcp/0"})
    with pytest.raises(ConfigError, match="^--n-gpu-layers: must be an integer"):
        load_config(None, {"model.n_gpu_layers": "lots"})


# --- --print-config ---------------------------------------------------------------------


def test_print_config_round_trips(tmp_path):
    secret = tmp_path / "acme.secret"
    secret.write_text("t" * 32)
    secret.chmod(0o600)
    p = write(tmp_path, f"""
[node]
listen = "/ip4/127.0.0.1/tcp/4001"
bootstrap = ["{BOOT}"]
mdns = false
ram_budget = "1.5GiB"
disk_budget = 123457
[model]
path = "models/x.gguf"
n_gpu_layers = 2
[digest]
fanout = 5
[routing]
policy = "local"
margin_s = 0.5
[http]
listen = "127.0.0.1:8080"
[tenants.acme]
secret_file = "acme.secret"
allowed_peers = ["{PEER}"]
[tenants.shared]
visibility = "public"
""")
    cfg = load_config(p, {"node.ram_budget": "3GiB"})
    printed = config_to_toml(cfg)
    again = load_config(write(tmp_path, printed, "printed.toml"))
    assert again == cfg
    assert config_to_toml(again).splitlines()[2:] == printed.splitlines()[2:]


def test_print_config_redacts_secrets(tmp_path):
    p = write(tmp_path, """
[http]
listen = "127.0.0.1:8080"
api_key = "api-key-do-not-print"
[tenants.acme]
secret = "tenant-secret-do-not-print"
""")
    printed = config_to_toml(load_config(p))
    assert "do-not-print" not in printed
    assert "# api_key = (redacted)" in printed and "# secret = (redacted)" in printed
    tomllib.loads(printed)  # still valid TOML


@pytest.mark.parametrize(
    "text",
    [
        "x = " + "[" * 5000 + "]" * 5000,  # tomllib recursion
        "[node]\nn_ctx = " + "9" * 5000,  # beyond int()'s digit limit
        '[node]\ncache_dir = "~nosuchuser_prefixmesh/cache"',  # expanduser failure
        "[digest]\ninterval_s = " + "9" * 400,  # beyond float range
    ],
)
def test_hostile_config_text_is_a_config_error(text):
    """Inputs the fuzzer found: each must be a ConfigError, never another exception."""
    with pytest.raises(ConfigError):
        load_config(text=text)


def test_http_keys_bind_api_keys_to_tenants_and_are_redacted():
    cfg = load_config(text='[http]\nlisten = "127.0.0.1:8080"\n[http.keys]\n"sk-one" = "acme"\n'
                      '[tenants.acme]\nsecret = "s3cret-acme-0123456789"\n')
    assert cfg.http.keys == {"sk-one": "acme"}
    printed = config_to_toml(cfg)
    assert "sk-one" not in printed and "s3cret-acme-0123456789" not in printed
    with pytest.raises(ConfigError, match="not a configured tenant"):
        load_config(text='[http.keys]\n"sk-one" = "nobody"\n')
    with pytest.raises(ConfigError, match=r"\[http\]\.keys"):
        load_config(text='[http.keys]\n"sk-one" = 3\n')


# --- [limits] ---------------------------------------------------------------------------


def test_limits_defaults_and_values(tmp_path):
    lim = load_config().limits
    assert (lim.peer_request_rate, lim.peer_request_burst) == (50.0, 100.0)
    assert lim.max_peers_per_subnet == 4 and lim.max_inbound_per_subnet == 32
    assert (lim.digest_exchange_rate, lim.digest_exchange_burst) == (4.0, 8.0)
    # the digest exchange's defaults are the config defaults
    from prefixmesh.overlay.digestexchange import ExchangeSettings

    assert ExchangeSettings().exchange_rate_per_s == lim.digest_exchange_rate
    assert ExchangeSettings().exchange_burst == lim.digest_exchange_burst
    cfg = load_config(write(tmp_path, "[limits]\npeer_request_rate = 5\npeer_request_burst = 1\n"
                                      "max_peers_per_subnet = 0\ndigest_exchange_rate = 0.5\n"
                                      "digest_exchange_burst = 2.5\nmax_inbound_per_subnet = 0\n"))
    lim = cfg.limits
    assert lim.max_inbound_per_subnet == 0
    assert lim.peer_request_rate == 5.0 and isinstance(lim.peer_request_rate, float)
    assert lim.peer_request_burst == 1.0 and lim.max_peers_per_subnet == 0
    assert (lim.digest_exchange_rate, lim.digest_exchange_burst) == (0.5, 2.5)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("peer_request_rate = 0", "[limits].peer_request_rate: 0 is out of range (more than 0"),
        ("peer_request_rate = -1.5", "[limits].peer_request_rate: -1.5 is out of range"),
        ("peer_request_rate = 'fast'", '[limits].peer_request_rate: "fast" is not a number'),
        ("peer_request_rate = nan", "[limits].peer_request_rate: nan is out of range"),
        ("peer_request_rate = inf", "[limits].peer_request_rate: inf is out of range"),
        ("peer_request_burst = 0.5", "[limits].peer_request_burst: 0.5 is out of range "
                                     "(at least 1.0"),
        ("peer_request_burst = true", "[limits].peer_request_burst: must be a number, not a "
                                      "boolean"),
        ("max_peers_per_subnet = -1", "[limits].max_peers_per_subnet: -1 is out of range"),
        ("max_peers_per_subnet = 2.0", "[limits].max_peers_per_subnet: must be an integer"),
        ("max_inbound_per_subnet = -2", "[limits].max_inbound_per_subnet: -2 is out of range"),
        ("digest_exchange_rate = 0.0", "[limits].digest_exchange_rate: 0.0 is out of range"),
        ("digest_exchange_burst = 0", "[limits].digest_exchange_burst: 0 is out of range"),
        ("digest_exchange_burst = [6]", "[limits].digest_exchange_burst: must be a number, not "
                                        "a list"),
        ("peer_rate = 3", "[limits].peer_rate: unknown key (known: peer_request_rate,"),
    ],
)
def test_limits_bad_values_name_the_key(tmp_path, text, expected):
    assert expected in err(tmp_path, "[limits]\n" + text + "\n")


def test_limits_section_must_be_a_table(tmp_path):
    assert "[limits]: must be a table" in err(tmp_path, "limits = 3\n")


def test_limits_print_config_round_trips(tmp_path):
    cfg = load_config(write(tmp_path, "[limits]\npeer_request_rate = 7.5\n"
                                      "max_peers_per_subnet = 0\ndigest_exchange_burst = 9\n"))
    printed = config_to_toml(cfg)
    doc = tomllib.loads(printed)
    assert doc["limits"] == {"peer_request_rate": 7.5, "peer_request_burst": 100.0,
                             "max_peers_per_subnet": 0, "max_inbound_per_subnet": 32,
                             "digest_exchange_rate": 4.0, "digest_exchange_burst": 9.0}
    assert "max_peers_per_subnet = 0  # peers per IPv4 /24" in printed
    assert load_config(write(tmp_path, printed, "printed.toml")) == cfg


def test_node_print_config_shows_limits(tmp_path, capsys):
    from prefixmesh.cli import main

    p = write(tmp_path, "[limits]\ndigest_exchange_rate = 4.0\n")
    assert main(["node", "--config", str(p), "--print-config"]) == 0
    doc = tomllib.loads(capsys.readouterr().out)
    assert doc["limits"]["digest_exchange_rate"] == 4.0
    assert doc["limits"]["peer_request_rate"] == 50.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("compaction_ratio = 0", "[digest].compaction_ratio: 0 is out of range"),
        ("compaction_ratio = 65", "[digest].compaction_ratio: 65 is out of range"),
        ("compaction_ratio = 'often'", '[digest].compaction_ratio: "often" is not a number'),
        ("bucket_summaries = 'maybe'", "[digest].bucket_summaries:"),
    ],
)
def test_digest_scale_knobs_bad_values_name_the_key(tmp_path, text, expected):
    assert expected in err(tmp_path, "[digest]\n" + text + "\n")


def test_digest_scale_knobs_defaults_and_values(tmp_path):
    assert load_config(None).digest.bucket_summaries is True
    assert load_config(None).digest.compaction_ratio == 4.0
    cfg = load_config(write(tmp_path, "[digest]\nbucket_summaries = false\ncompaction_ratio = 1\n"))
    assert cfg.digest.bucket_summaries is False and cfg.digest.compaction_ratio == 1.0


def test_digest_partition_keys_defaults_and_values(tmp_path):
    d = load_config(None).digest
    assert d.partitions == 0  # full replication unless asked for
    assert (d.replicas, d.partition_refresh_s, d.partition_ttl_s) == (3, 300.0, 900.0)
    for partitions, replicas in ((1, 1), (16, 2), (65536, 16)):
        cfg = load_config(write(
            tmp_path, f"[digest]\npartitions = {partitions}\nreplicas = {replicas}\n"
                      "partition_refresh_s = 60\npartition_ttl_s = 180\n"))
        assert (cfg.digest.partitions, cfg.digest.replicas) == (partitions, replicas)
        assert (cfg.digest.partition_refresh_s, cfg.digest.partition_ttl_s) == (60.0, 180.0)
    assert d.min_record_interval_s == 0.0  # every tick with changes, as before
    cfg = load_config(write(tmp_path, "[digest]\nmin_record_interval_s = 5\n"))
    assert cfg.digest.min_record_interval_s == 5.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("partitions = -1", "[digest].partitions: -1 is out of range (0..65536)"),
        ("partitions = 65537", "[digest].partitions: 65537 is out of range (0..65536)"),
        ("partitions = 1.5", "[digest].partitions: must be an integer"),
        ("replicas = 0", "[digest].replicas: 0 is out of range (1..16)"),
        ("replicas = 17", "[digest].replicas: 17 is out of range (1..16)"),
        ("replicas = true", "[digest].replicas: must be an integer"),
        ("partition_refresh_s = 0", "[digest].partition_refresh_s: 0 is out of range"),
        ("partition_ttl_s = 0.5", "[digest].partition_ttl_s: 0.5 is out of range"),
        ("partition_ttl_s = 3601", "[digest].partition_ttl_s: 3601 is out of range"),
        ("min_record_interval_s = -1", "[digest].min_record_interval_s: -1 is out of range"),
        ("min_record_interval_s = 4000", "[digest].min_record_interval_s: 4000 is out of range"),
    ],
)
def test_digest_partition_keys_bad_values_name_the_key(tmp_path, text, expected):
    assert expected in err(tmp_path, "[digest]\n" + text + "\n")


def test_engine_keys_reach_the_engine(tmp_path):
    from _model_fixture import default_model_path

    from prefixmesh.node.process import NodeOptions, make_backend

    cfg = load_config(write(tmp_path, (
        f'[model]\npath = "{default_model_path()}"\nkv_type_k = "q8_0"\nflash_attn = true\n'
        'live_sequence = true\nbatch_mode = "throughput"\n[node]\nkv_write_delay_s = 0.5\n')))
    backend = make_backend(cfg, NodeOptions())  # reads the GGUF header only; no load
    o = backend._engine_overrides
    assert (o["type_k"], o["type_v"], o["flash_attn"], o["live_sequence"], o["batch_mode"],
            o["write_delay_s"]) == ("q8_0", "f16", True, True, "throughput", 0.5)
    defaults = load_config()
    assert (defaults.model.kv_type_k, defaults.model.batch_mode) == ("f16", "deterministic")


@pytest.mark.parametrize("text, key", [
    ('[model]\nkv_type_k = "q3"\n', "kv_type_k"),
    ('[model]\nbatch_mode = "fast"\n', "batch_mode"),
    ('[node]\nkv_write_delay_s = -1\n', "kv_write_delay_s"),
])
def test_bad_engine_keys_are_named(tmp_path, text, key):
    with pytest.raises(ConfigError, match=key):
        load_config(write(tmp_path, text))


def test_share_cap_and_spot_checks_are_routing_keys_off_by_default(tmp_path):
    assert (load_config().routing.share_cap, load_config().routing.spot_check_fraction) == (
        False, 0.0)
    cfg = load_config(write(tmp_path, "[routing]\nshare_cap = true\nspot_check_fraction = 0.25\n"))
    assert (cfg.routing.share_cap, cfg.routing.spot_check_fraction) == (True, 0.25)
    assert "share_cap = true" in config_to_toml(cfg)
    assert load_config(text=config_to_toml(cfg)).routing == cfg.routing


@pytest.mark.parametrize("text", [
    "[routing]\nshare_cap = 1\n",
    "[routing]\nspot_check_fraction = 1.5\n",
    "[routing]\nspot_check_fraction = -0.1\n",
    '[routing]\nspot_check_fraction = "often"\n',
])
def test_bad_share_cap_or_spot_check_values_are_named(tmp_path, text):
    key = text.split("\n")[1].split(" =")[0]
    with pytest.raises(ConfigError, match=rf"\[routing\]\.{key}"):
        load_config(write(tmp_path, text))
