"""prefixmesh/__main__.py: ``python -m prefixmesh`` is the ``prefixmesh`` console script:
the same ``main``, its exit status passed through as the process's. (The CLI itself:
tests/test_cli*.py.)"""

from __future__ import annotations

import runpy
import subprocess
import sys

import pytest

from prefixmesh.cli import main


def _run_module(monkeypatch, *argv: str) -> int:
    monkeypatch.setattr(sys, "argv", ["prefixmesh", *argv])
    with pytest.raises(SystemExit) as info:
        runpy.run_module("prefixmesh", run_name="__main__", alter_sys=True)
    return info.value.code


def test_module_runs_main_and_exits_with_its_status(monkeypatch, capsys):
    assert _run_module(monkeypatch, "--version") == 0
    via_module = capsys.readouterr()
    assert main(["--version"]) == 0
    assert capsys.readouterr() == via_module and via_module.out.startswith("prefixmesh ")
    # a usage error: main's status 2 becomes the exit status, its one line on stderr
    assert _run_module(monkeypatch, "no-such-command") == 2
    assert "no-such-command" in capsys.readouterr().err


def test_python_dash_m_in_a_real_process():
    proc = subprocess.run([sys.executable, "-m", "prefixmesh", "--version"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("prefixmesh "), proc.stderr
