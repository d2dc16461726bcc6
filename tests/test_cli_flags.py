"""The node's log flags and the clients' answer flags reach the configuration (argparse +
config only: nothing is started)."""

from __future__ import annotations

import tomllib

import pytest

from prefixmesh import cli
from prefixmesh.cli import main


def _printed(capsys, *flags: str) -> dict:
    assert main(["node", *flags, "--print-config"]) == 0
    return tomllib.loads(capsys.readouterr().out)


def test_log_level_and_format_flags(capsys):
    doc = _printed(capsys, "--log-level", "warning", "--log-format", "json")
    assert doc["node"]["log_level"] == "warning" and doc["node"]["log_format"] == "json"
    assert _printed(capsys, "-v")["node"]["log_level"] == "debug"
    # an explicit level wins over -v, in either order
    assert _printed(capsys, "-v", "--log-level", "error")["node"]["log_level"] == "error"
    assert _printed(capsys, "--log-level", "error", "-v")["node"]["log_level"] == "error"
    assert _printed(capsys)["node"]["log_format"] == "text"


@pytest.mark.parametrize(("flags", "where"), [
    (["--log-level", "loud"], "--log-level"),
    (["--log-format", "xml"], "--log-format"),
])
def test_bad_log_flags_are_one_line_usage_errors(capsys, flags, where):
    assert main(["node", *flags, "--print-config"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and where in err, err


@pytest.mark.parametrize("command", ["chat", "ask"])
def test_max_tokens_and_timeout_reach_the_client_config(monkeypatch, command):
    seen = {}

    def fake_component(module, name, what):
        def run(cfg, *args, **kwargs):
            seen["cfg"] = cfg
            return 0
        return run

    monkeypatch.setattr(cli, "_component", fake_component)
    argv = [command, "--max-tokens", "7", "--timeout", "2.5"]
    if command == "ask":
        argv.append("hello")
    assert main(argv) == 0
    assert seen["cfg"].client.max_tokens == 7
    assert seen["cfg"].client.timeout_s == 2.5


@pytest.mark.parametrize(("flag", "value"), [("--timeout", "0"), ("--timeout", "soon"),
                                             ("--max-tokens", "-3")])
def test_bad_answer_flags_are_one_line_usage_errors(capsys, flag, value):
    assert main(["chat", flag, value]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err, err
