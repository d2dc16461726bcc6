"""Engine options the node's config validates without importing the engine (which brings
llama.cpp's bindings, numpy and jinja2: 0.1 s the node's start need not wait for)."""

from __future__ import annotations

__all__ = ["KV_TYPES", "BATCH_MODES"]

# KV cache element types offered (GGML type ids); see docs/bench/engine.md for measurements
KV_TYPES = {"f16": 1, "q8_0": 8, "q5_1": 7, "q5_0": 6, "q4_1": 3, "q4_0": 2}
# "deterministic": one sequence per decode, bit-identical to a cold run; "throughput":
# shared batches (docs/bench/engine.md)
BATCH_MODES = ("deterministic", "throughput")
