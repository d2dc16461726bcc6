"""prefixmesh/cli.py: help, usage errors, keygen, node --print-config, error lines."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import _forkserver
import pytest

from prefixmesh.cli import CliError, _component, main
from prefixmesh.node.config import load_config
from prefixmesh.overlay.keyfile import load_identity

REPO = Path(__file__).resolve().parents[1]
SUBCOMMANDS = [["keygen"], ["node"], ["chat"], ["ask"], ["peers"], ["demo"], ["model"],
               ["model", "fetch"], ["bench"]]


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    # forked from the pre-imported fork server where it can be (saves ~1.5 s of imports)
    return _forkserver.run([sys.executable, "-m", "prefixmesh", *args], cwd=cwd, timeout=60)


# --- help and usage errors --------------------------------------------------------------


def test_help_in_a_subprocess_imports_nothing_heavy():
    code = ("import sys; from prefixmesh.cli import main; rc = main(['--help']); "
            "heavy = [m for m in ('trio', 'libp2p', 'llama_cpp') if m in sys.modules]; "
            "print('HEAVY', heavy); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0
    assert "usage: prefixmesh" in proc.stdout and "HEAVY []" in proc.stdout
    for name in ("keygen", "node", "chat", "ask", "peers", "demo", "model", "bench"):
        assert name in proc.stdout


def test_python_dash_m_version():
    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("prefixmesh ")


@pytest.mark.parametrize("cmd", SUBCOMMANDS, ids=" ".join)
def test_subcommand_help(cmd, capsys):
    assert main([*cmd, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: prefixmesh {' '.join(cmd)}")


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["node", "--bogus"],
        ["keygen", "--out"],
        ["ask"],
        ["ask", "--max-tokens", "many", "hi"],
        ["node", "--n-ctx"],
        ["model"],
        ["bench"],
    ],
    ids=lambda a: " ".join(a) or "(none)",
)
def test_usage_errors_exit_2_with_one_line(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "error:" in err


def test_usage_error_from_the_console_script():
    script = Path(sys.executable).parent / "prefixmesh"
    if not script.exists():
        pytest.skip("console script not installed in this environment")
    proc = subprocess.run([str(script), "node", "--nope"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "unrecognized arguments: --nope" in proc.stderr


# --- keygen -----------------------------------------------------------------------------


def test_keygen_writes_0600_and_refuses_overwrite(tmp_path, capsys):
    key = tmp_path / "keys" / "node.key"
    assert main(["keygen", "--out", str(key)]) == 0
    peer_id = capsys.readouterr().out.strip()
    assert peer_id.startswith("12D3KooW")
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert load_identity(key).peer_id_b58 == peer_id

    before = key.read_bytes()
    assert main(["keygen", "--out", str(key)]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--force" in err
    assert key.read_bytes() == before

    assert main(["keygen", "--out", str(key), "--force"]) == 0
    new_id = capsys.readouterr().out.strip()
    assert new_id != peer_id and load_identity(key).peer_id_b58 == new_id


def test_keygen_default_path_in_a_subprocess(tmp_path):
    proc = run_cli("keygen", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    key = tmp_path / "keys" / "node.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert load_identity(key).peer_id_b58 == proc.stdout.strip()


# --- node --print-config ----------------------------------------------------------------


def test_node_print_config_applies_flags(tmp_path, capsys):
    cfg_file = tmp_path / "node.toml"
    cfg_file.write_text('[node]\nram_budget = "1GiB"\nmdns = true\n[model]\nn_gpu_layers = 3\n')
    rc = main(["node", "--config", str(cfg_file), "--ram-budget", "3GiB", "--no-mdns",
               "--listen", "/ip4/127.0.0.1/tcp/4555", "--http", "127.0.0.1:8081",
               "-v", "--print-config"])
    assert rc == 0
    printed = capsys.readouterr().out
    doc = tomllib.loads(printed)
    assert doc["node"]["ram_budget"] == "3GiB"
    assert doc["node"]["mdns"] is False
    assert doc["node"]["listen"] == "/ip4/127.0.0.1/tcp/4555"
    assert doc["node"]["log_level"] == "debug"
    assert doc["model"]["n_gpu_layers"] == 3  # from the file, no flag given
    assert doc["http"]["listen"] == "127.0.0.1:8081"
    # round trip: the printed config loads back to the same effective config
    again = tmp_path / "printed.toml"
    again.write_text(printed)
    assert load_config(again) == load_config(
        cfg_file, {"node.ram_budget": "3GiB", "node.mdns": False,
                   "node.listen": "/ip4/127.0.0.1/tcp/4555", "http.listen": "127.0.0.1:8081",
                   "node.log_level": 1})


@pytest.mark.parametrize(
    ("toml", "flags", "rc", "expected"),
    [
        ('[node]\nram_budget = "12 parsecs"\n', [], 1,
         'config error: [node].ram_budget: "12 parsecs" is not a size (use e.g. 512MiB, 2GB)'),
        ("", ["--ram-budget", "12 parsecs"], 2,
         'config error: --ram-budget: "12 parsecs" is not a size'),
        ("", ["--listen", "/ip4/0.0.0.0/tcp/4001"], 2, "config error: --listen:"),
        ('[node]\nlisten = "/ip4/0.0.0.0/tcp/4001"\n', [], 1, "config error: [node].listen:"),
        ("", ["--bootstrap", "/ip4/127.0.0.1/tcp/4001"], 2,
         "config error: --bootstrap: [0] \"/ip4/127.0.0.1/tcp/4001\" lacks the peer id"),
        ("[tenants.acme]\nsecret_file = 'nope'\n", [], 1,
         "config error: [tenants.acme].secret_file:"),
        ("[node\n", [], 1, "invalid TOML"),
    ],
)
def test_node_config_errors_are_one_line(tmp_path, capsys, toml, flags, rc, expected):
    cfg_file = tmp_path / "node.toml"
    cfg_file.write_text(toml)
    assert main(["node", "--config", str(cfg_file), *flags, "--print-config"]) == rc
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    assert expected in captured.err


def test_group_readable_secret_file_is_a_one_line_error(tmp_path, capsys):
    secret = tmp_path / "acme.secret"
    secret.write_text("x" * 32)
    secret.chmod(0o644)
    cfg_file = tmp_path / "node.toml"
    cfg_file.write_text("[tenants.acme]\nsecret_file = 'acme.secret'\n")
    assert main(["node", "--config", str(cfg_file), "--print-config"]) == 1
    err = capsys.readouterr().err
    assert "readable by group or others" in err and "chmod 600" in err
    assert len(err.strip().splitlines()) == 1


def test_client_unknown_tenant_is_one_line(tmp_path, capsys):
    assert main(["ask", "--tenant", "acme", "hello"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert 'config error: --tenant: "acme" is not a configured tenant (pass --config' in err


def test_missing_component_is_a_clear_message():
    with pytest.raises(CliError, match="not available in this build"):
        _component("prefixmesh.node.no_such_module", "run", "the thing")
    with pytest.raises(CliError, match=r"prefixmesh\.node\.config\.nope is missing"):
        _component("prefixmesh.node.config", "nope", "the thing")


def test_unexpected_error_is_one_line_unless_verbose(monkeypatch, capsys):
    import prefixmesh.cli as cli

    def boom(args):
        raise RuntimeError("kaputt")

    monkeypatch.setattr(cli, "_cmd_keygen", boom)
    # handlers are bound when the parser is built, so rebuild it per call
    assert main(["keygen"]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "prefixmesh keygen: internal error: RuntimeError: kaputt (run with -v for the traceback)"
    ]
    assert main(["-v", "keygen"]) == 1
    assert "Traceback" in capsys.readouterr().err


def test_examples_are_valid_for_print_config(tmp_path, capsys):
    rc = main(["node", "--config", str(REPO / "examples" / "volunteer-node.toml"),
               "--print-config"])
    assert rc == 0
    assert "advertise" in capsys.readouterr().out


def test_no_env_leak():
    # the CLI must not depend on a PREFIXMESH_* variable being set in tests
    assert not [k for k in os.environ if k.startswith("PREFIXMESH_") and k != "PREFIXMESH_CACHE_DIR"]


def test_errors_inside_exception_groups_are_unwrapped(monkeypatch, capsys):
    import prefixmesh.cli as cli
    from prefixmesh.node.config import ConfigError

    def nursery_failure(args):
        raise ExceptionGroup("Exceptions from Trio nursery", [
            ExceptionGroup("inner", [ConfigError("[node].listen", "address in use")])])

    monkeypatch.setattr(cli, "_cmd_keygen", nursery_failure)
    assert main(["keygen"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "config error: [node].listen: address in use"]

    def interrupted(args):
        raise BaseExceptionGroup("x", [KeyboardInterrupt()])

    monkeypatch.setattr(cli, "_cmd_keygen", interrupted)
    assert main(["keygen"]) == 130


def test_keygen_uses_the_config_key_file(tmp_path, capsys):
    cfg = tmp_path / "node.toml"
    cfg.write_text('[node]\nkey_file = "ids/me.key"\n')
    assert main(["keygen", "--config", str(cfg)]) == 0
    peer_id = capsys.readouterr().out.strip()
    assert load_identity(tmp_path / "ids" / "me.key").peer_id_b58 == peer_id


def test_bench_arguments_pass_through(monkeypatch, capsys):
    import types

    import prefixmesh.cli as cli

    seen = {}
    raw = types.ModuleType("prefixmesh_fake_bench_raw")
    raw.run = lambda argv: seen.setdefault("raw", argv) and 0
    parsed = types.ModuleType("prefixmesh_fake_bench_parsed")
    parsed.__doc__ = "A fake benchmark.\n\nMore."
    parsed.add_fake_arguments = lambda p: p.add_argument("--nodes", type=int, default=1)
    parsed.run = lambda ns: seen.setdefault("ns", ns) and 0
    monkeypatch.setitem(sys.modules, raw.__name__, raw)
    monkeypatch.setitem(sys.modules, parsed.__name__, parsed)

    def args(*rest):
        return type("A", (), {"bench_args": ["--", *rest]})()

    assert cli._bench(raw.__name__, "run", "fake")(args("--x", "1", "-h")) == 0
    assert seen["raw"] == ["--x", "1", "-h"]
    assert cli._bench(parsed.__name__, "run", "fake")(args("--nodes", "7")) == 0
    assert seen["ns"].nodes == 7
    assert cli._bench(parsed.__name__, "run", "fake")(args("--nodes", "x")) == 2
    err = capsys.readouterr().err
    assert err.startswith("prefixmesh bench fake: error: argument --nodes")
    assert len(err.strip().splitlines()) == 1
    assert cli._bench(parsed.__name__, "run", "fake")(args("--help")) == 0
    assert "A fake benchmark." in capsys.readouterr().out


def test_bench_sim_help_goes_to_the_simulator(capsys):
    assert main(["bench", "sim", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: prefixmesh bench sim")
