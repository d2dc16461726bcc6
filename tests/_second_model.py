"""Shared helper: a second real model, made locally from the embedded one.

The embedded SmolLM2-135M-Instruct Q4_1 requantized to Q4_0 with llama.cpp's own
quantizer (``llama_cpp.llama_model_quantize``): same architecture and tokenizer, other
tensor types, hence another GGUF fingerprint and another model in the mesh. Made once
and cached next to the default model (like ``_model_fixture`` caches that one); a
partial file never survives (written under a temporary name, then renamed).
Not a conftest: import ``second_model_path`` from here.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

try:
    from _model_fixture import default_model_path
except ImportError:  # pragma: no cover - running from another directory
    from tests._model_fixture import default_model_path

SECOND_MODEL_NAME = "SmolLM2-135M-Instruct.Q4_0"


@functools.cache
def second_model_path() -> Path:
    import llama_cpp

    source = default_model_path()
    target = source.with_name(SECOND_MODEL_NAME + ".gguf")
    if target.is_file() and target.stat().st_size > 0:
        return target
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.allow_requantize = True  # the source is already quantized (Q4_1)
    params.nthread = 1
    try:
        rc = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(),
                                            params)
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize failed ({rc}) for {source}")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
