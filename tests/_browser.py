"""Test helper: headless Chromium for the dashboard tests (the Debian package
``chromium``; ``make browser`` installs it). A test that needs it skips when it is absent.
Not a test module."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which(
        "google-chrome")


def browser(url: str, *extra: str, budget_ms: int = 8000) -> subprocess.CompletedProcess:
    """Load ``url`` in a fresh headless profile with ``extra`` flags (``--dump-dom``,
    ``--screenshot=PATH``); the page's timers run for ``budget_ms`` of virtual time."""
    exe = chromium()
    if exe is None:
        pytest.skip("Chromium is not installed and cannot be here (make test installs the "
                    "Debian package 'chromium' where apt-get works)")
    with tempfile.TemporaryDirectory(prefix="pm-chromium-") as profile:
        cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
               "--no-first-run", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
               f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}",
               "--window-size=1280,960", *extra, url]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, HOME=profile))
