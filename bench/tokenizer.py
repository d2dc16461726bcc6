"""Tokenisers for benchmark workloads: the default model's vocabulary, or a documented proxy.

The simulator only needs token ids that reproduce the *shared-prefix structure* of real
prompts: two prompts that share a text prefix must share (almost) the same token prefix,
and prompt lengths should be close to a real BPE tokenizer's. Two implementations:

- :class:`LlamaVocabTokenizer`: the default model's own tokenizer, loaded with
  ``llama_cpp.Llama(model_path, vocab_only=True)`` (fast, no weights). Used when
  llama-cpp-python is importable and the default model file is already on disk (the
  benchmark never fetches a model).
- :class:`ProxyTokenizer` (``proxy-v2``): deterministic and dependency-free. Text is split
  GPT-2 style with one regex into pieces: an optional leading space plus a run of letters
  (cut into chunks of at most ``MAX_WORD_PIECE`` letters, a stand-in for BPE sub-words), a
  single digit, a run of other punctuation, or a whole run of whitespace (unlike GPT-2, a
  whitespace run is never split before a word, so a prompt ending in ``"\n\n"`` is a token
  prefix of any continuation that starts with a non-space). Each piece maps to
  ``crc32(piece) & 0x7fffffff``. Splitting is left to right and each piece depends only on
  the text around it, so two texts with a common prefix get a common token prefix except at
  most the last piece before they diverge, which is how a real BPE behaves too. On the MMLU
  trace it gives ~1.2 tokens per whitespace word (Qwen2.5: 1.39).

Chat requests are rendered with ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n``, then
``<|im_start|>assistant\\n``), the default model's (SmolLM2-Instruct) template; the proxy
simply tokenises the rendered text. A conversation's request for round r is then a text
prefix of its request for round r+1, as with the real template.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Protocol

__all__ = [
    "Tokenizer",
    "ProxyTokenizer",
    "LlamaVocabTokenizer",
    "load_tokenizer",
    "render_chatml",
    "MAX_WORD_PIECE",
]

MAX_WORD_PIECE = 6

_PIECE_RE = re.compile(
    r"'(?:[sdmt]|ll|ve|re)| ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+"
)


class Tokenizer(Protocol):
    name: str  # identifies the vocabulary; part of every tokenisation cache key

    def encode(self, text: str) -> list[int]: ...


def render_chatml(messages: Iterable[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
    """Render OpenAI-style chat messages with the ChatML template."""
    parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


class ProxyTokenizer:
    """Deterministic regex-split, crc32-hashed token ids (see the module docstring)."""

    name = "proxy-v2"

    def __init__(self) -> None:
        self._ids: dict[str, tuple[int, ...]] = {}

    def encode(self, text: str) -> list[int]:
        ids = self._ids
        out: list[int] = []
        for piece in _PIECE_RE.findall(text):
            got = ids.get(piece)
            if got is None:
                got = self._piece_ids(piece)
                if len(ids) < 2_000_000:  # bounded memo
                    ids[piece] = got
            out.extend(got)
        return out

    @staticmethod
    def _piece_ids(piece: str) -> tuple[int, ...]:
        core = piece.lstrip(" ")
        if core.isalpha() and len(core) > MAX_WORD_PIECE:
            lead = piece[: len(piece) - len(core)]
            chunks = [core[i : i + MAX_WORD_PIECE] for i in range(0, len(core), MAX_WORD_PIECE)]
            chunks[0] = lead + chunks[0]
        else:
            chunks = [piece]
        return tuple(zlib.crc32(c.encode("utf-8")) & 0x7FFFFFFF for c in chunks)


class LlamaVocabTokenizer:
    """The default model's tokenizer via llama.cpp (vocabulary only, no weights loaded)."""

    def __init__(self, model_path: str | Path) -> None:
        import llama_cpp  # noqa: PLC0415 - optional, heavy import

        path = Path(model_path)
        self._llama = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        st = path.stat()
        tag = hashlib.sha256(f"{path.name}:{st.st_size}".encode()).hexdigest()[:12]
        self.name = f"llama-{tag}"

    def encode(self, text: str) -> list[int]:
        return list(self._llama.tokenize(text.encode("utf-8"), add_bos=False, special=True))


def load_tokenizer(kind: str = "auto") -> Tokenizer:
    """``proxy``, ``llama`` (fails if unavailable) or ``auto`` (llama if possible, else proxy)."""
    if kind == "proxy":
        return ProxyTokenizer()
    if kind not in ("auto", "llama"):
        raise ValueError(f"unknown tokenizer {kind!r}: expected auto, llama or proxy")
    try:
        from prefixmesh.inference.model import default_model_path  # noqa: PLC0415

        path = default_model_path()
        if not Path(path).is_file():
            raise FileNotFoundError(f"default model not fetched: {path}")
        return LlamaVocabTokenizer(path)
    except Exception:
        if kind == "llama":
            raise
        return ProxyTokenizer()
