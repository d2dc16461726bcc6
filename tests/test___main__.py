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


# Ctrl-C arriving while the CLI is still being imported: a finder that interrupts that
# import stands in for the signal (whose moment a test cannot choose)
_INTERRUPTED_IMPORT = """
import sys
class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == "prefixmesh.cli":
            raise KeyboardInterrupt
sys.meta_path.insert(0, Interrupt())
from prefixmesh.__main__ import main
sys.exit(main())
"""


def test_ctrl_c_while_the_cli_is_imported_exits_130_without_a_traceback():
    proc = subprocess.run([sys.executable, "-c", _INTERRUPTED_IMPORT, "node"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr == "\n"


def test_the_console_script_is_this_module_s_main():
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "prefixmesh"]
    assert script.value == "prefixmesh.__main__:main"
