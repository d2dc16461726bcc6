"""inference/options.py: the engine options the node's config validates, without the
engine's import (llama.cpp's bindings, numpy, jinja2)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from prefixmesh.inference.options import BATCH_MODES, KV_TYPES
from prefixmesh.node.config import ConfigError, load_config


def test_the_config_takes_every_option_and_names_them_when_refusing():
    for kv in KV_TYPES:
        assert load_config(None, {"model.kv_type_k": kv}).model.kv_type_k == kv
    for mode in BATCH_MODES:
        assert load_config(None, {"model.batch_mode": mode}).model.batch_mode == mode
    with pytest.raises(ConfigError, match="q8_0"):
        load_config(None, {"model.kv_type_v": "q3_k"})
    with pytest.raises(ConfigError, match="throughput"):
        load_config(None, {"model.batch_mode": "fast"})


def test_the_engine_uses_the_same_options():
    from prefixmesh.inference import engine

    assert engine.KV_TYPES is KV_TYPES and engine.BATCH_MODES is BATCH_MODES


def test_validating_a_config_imports_no_engine():
    done = subprocess.run(
        [sys.executable, "-c", "import sys; import prefixmesh.node.config; "
         "print([m for m in ('prefixmesh.inference.engine', 'numpy', 'llama_cpp') "
         "if m in sys.modules])"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
