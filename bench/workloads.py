"""Benchmark workloads: request traces with shared prompt prefixes, tokenised and cached.

A :class:`Workload` is a list of :class:`Request` (arrival time, prompt token ids, output
length) sorted by arrival. Sources:

``mmlu`` (the reference paper's setting)
    ``<shared>/workloads/mmlu_zipf_trace.jsonl.gz``: 10,000 MMLU 5-shot prompts, subject
    popularity Zipf(1.0), Poisson arrivals at 4/s. One output token (the answer letter).
``mmlu-gen``
    The same construction regenerated from ``<shared>/workloads/mmlu/`` with another Zipf
    ``alpha``, ``rate`` or ``seed`` (subjects ranked by a seeded shuffle; questions drawn
    uniformly from the subject's test split; classic 5-shot prefix from its dev split).
``sharegpt``
    ``<shared>/workloads/sharegpt_multiturn.jsonl.gz``: each round r of a conversation is
    a chat request of rounds[0..r-1] + rounds[r].user; conversations start as a Poisson
    process and round r+1 arrives an exponential think time (mean ``think_s``) after round
    r. Output length: the recorded assistant reply's token count, capped at
    ``max_output``. Internal benchmarking only: that data must never enter the repository.
``synthetic``
    Built in, no files needed: shared system prompts + documents, both Zipf-popular, plus
    multi-turn follow-ups; token ids drawn directly from a seeded RNG.
generic JSONL (``--workload PATH``)
    gzip or plain JSONL, one request per line: ``arrival_s`` (float seconds) and either
    ``prompt`` (text) or ``messages`` (OpenAI-style ``[{"role", "content"}]``, rendered with
    ChatML); optional ``max_tokens`` (default 16). The format of a file is detected from its
    first line (``prompt_prefix`` -> MMLU trace, ``rounds`` -> ShareGPT, otherwise generic).

The shared folder is ``--shared-dir``, else ``$PREFIXMESH_SHARED_DIR``, else
``<repo root>/../shared``. Tokenised workloads are cached on disk under
``<prefixmesh cache dir>/bench/`` keyed by a SHA-256 of the source content, the loader
parameters and the tokenizer's name, so sweeps tokenise each workload once.

The *ideal hit ratio* of a workload (:meth:`Workload.ideal_hit_ratio`) is the physical limit
of any prefix cache on it: for each request, the longest token prefix it shares with any
earlier request, summed, over all prompt tokens (an unlimited global cache).
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import math
import os
import pickle
import random
from array import array
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path

from .tokenizer import Tokenizer, load_tokenizer, render_chatml

__all__ = [
    "Request",
    "Workload",
    "WorkloadError",
    "shared_dir",
    "load_workload",
    "load_mmlu_trace",
    "generate_mmlu_trace",
    "load_sharegpt",
    "load_generic",
    "synthetic_workload",
    "ideal_hits",
]

_CACHE_VERSION = 2
_DEFAULT_MAX_TOKENS = 16


class WorkloadError(ValueError):
    """A workload could not be found, parsed or built."""


class Request:
    """One request of a trace. ``chain`` and friends are filled in lazily by the simulator."""

    __slots__ = ("req_id", "arrival_s", "tokens", "max_tokens", "group", "chain")

    def __init__(
        self,
        req_id: int,
        arrival_s: float,
        tokens: tuple[int, ...],
        max_tokens: int,
        group: str = "",
    ) -> None:
        self.req_id = req_id
        self.arrival_s = arrival_s
        self.tokens = tokens
        self.max_tokens = max_tokens
        self.group = group
        self.chain: list[bytes] | None = None

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id}, t={self.arrival_s:.3f}, {len(self.tokens)} tokens, "
            f"out={self.max_tokens})"
        )


@dataclass
class Workload:
    name: str
    requests: list[Request]
    tokenizer: str
    meta: dict = field(default_factory=dict)
    _ideal: list[int] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.requests)

    def ideal_per_request(self) -> list[int]:
        if self._ideal is None:
            self._ideal = ideal_hits(r.tokens for r in self.requests)
        return self._ideal

    def ideal_hit_ratio(self, n: int | None = None) -> float:
        """Ideal hit ratio over the first ``n`` requests (all by default)."""
        reqs = self.requests if n is None else self.requests[:n]
        total = sum(len(r.tokens) for r in reqs)
        return sum(self.ideal_per_request()[: len(reqs)]) / total if total else 0.0

    def head(self, n: int) -> Workload:
        """The first ``n`` requests (the ideal hit ratio of a head is the head's own)."""
        ideal = self._ideal[:n] if self._ideal is not None else None
        return Workload(self.name, self.requests[:n], self.tokenizer, dict(self.meta), ideal)

    def scaled(self, rate_factor: float) -> Workload:
        """The same requests with arrival times divided by ``rate_factor`` (new objects)."""
        reqs = [
            Request(r.req_id, r.arrival_s / rate_factor, r.tokens, r.max_tokens, r.group)
            for r in self.requests
        ]
        meta = dict(self.meta, rate_factor=rate_factor)
        return Workload(self.name, reqs, self.tokenizer, meta, self._ideal)


def ideal_hits(token_seqs: Iterator[Sequence[int]] | Sequence[Sequence[int]]) -> list[int]:
    """Per request, the longest token prefix shared with any earlier request.

    Uses a sorted list of earlier prompts: the longest common prefix of ``q`` with any
    element of a sorted set is reached at one of ``q``'s two neighbours in sort order.
    """
    seen: list[tuple[int, ...]] = []
    out: list[int] = []
    for seq in token_seqs:
        t = tuple(seq)
        i = bisect_left(seen, t)
        best = 0
        for j in (i - 1, i):
            if 0 <= j < len(seen):
                best = max(best, _lcp(seen[j], t))
        out.append(best)
        if i >= len(seen) or seen[i] != t:
            seen.insert(i, t)
    return out


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


# ------------------------------------------------------------------------ locations


def shared_dir(explicit: str | os.PathLike | None = None) -> Path:
    """The shared folder holding ``workloads/`` (see the module docstring)."""
    if explicit:
        return Path(explicit).expanduser()
    env = os.environ.get("PREFIXMESH_SHARED_DIR")
    if env:
        return Path(env).expanduser()
    repo_root = Path(__file__).resolve().parent.parent
    return repo_root.parent / "shared"


def _cache_dir() -> Path:
    try:
        from prefixmesh.inference.model import cache_dir  # noqa: PLC0415

        base = Path(cache_dir())
    except Exception:
        base = Path.home() / ".cache" / "prefixmesh"
    return base / "bench"


def _open_text(path: Path) -> io.TextIOBase:
    with open(path, "rb") as fh:
        magic = fh.read(2)
    if magic == b"\x1f\x8b":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")  # noqa: SIM115


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------------ caching


def _cached(key_parts: dict, build, use_cache: bool) -> list[tuple]:
    """Rows ``(arrival_s, token array, max_tokens, group)`` from cache or ``build()``."""
    key = hashlib.sha256(
        json.dumps(dict(key_parts, v=_CACHE_VERSION), sort_keys=True).encode()
    ).hexdigest()[:32]
    path = _cache_dir() / f"{key}.pkl"
    if use_cache and path.is_file():
        try:
            with open(path, "rb") as fh:  # our own cache file, written below
                rows = pickle.load(fh)
            return rows
        except Exception:
            pass  # corrupt or stale: rebuild
    rows = build()
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            with open(tmp, "wb") as fh:
                pickle.dump(rows, fh, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache only costs time
    return rows


def _rows_to_workload(name: str, rows: list[tuple], tokenizer: str, meta: dict) -> Workload:
    rows = sorted(rows, key=lambda r: r[0])
    reqs = [
        Request(i, float(a), tuple(toks), int(mt), g) for i, (a, toks, mt, g) in enumerate(rows)
    ]
    return Workload(name, reqs, tokenizer, meta)


def _arr(tokens: Sequence[int]) -> array:
    return array("I", tokens)


# ------------------------------------------------------------------------ loaders


def load_mmlu_trace(
    path: Path, tok: Tokenizer, *, use_cache: bool = True, max_tokens: int = 1
) -> Workload:
    """The pre-built MMLU Zipf trace (``prompt = prompt_prefix + question``)."""

    def build() -> list[tuple]:
        rows = []
        with _open_text(path) as fh:
            for line in fh:
                if not line.strip():
                    continue
                d = json.loads(line)
                text = d["prompt_prefix"] + d["question"]
                rows.append(
                    (float(d["arrival_s"]), _arr(tok.encode(text)), max_tokens, d["subject"])
                )
        return rows

    key = {"kind": "mmlu", "src": _file_digest(path), "tok": tok.name, "mt": max_tokens}
    rows = _cached(key, build, use_cache)
    return _rows_to_workload("mmlu", rows, tok.name, {"source": str(path)})


def _read_mmlu_csv(path: Path) -> list[list[str]]:
    with open(path, encoding="utf-8", newline="") as fh:
        return [row for row in csv.reader(fh) if len(row) >= 6]


def _mmlu_item(row: Sequence[str], with_answer: bool) -> str:
    q, a, b, c, d, ans = row[:6]
    body = f"{q}\nA. {a}\nB. {b}\nC. {c}\nD. {d}\nAnswer:"
    return body + (f" {ans}\n\n" if with_answer else "")


def zipf_cdf(n: int, alpha: float) -> list[float]:
    weights = [1.0 / (k**alpha) for k in range(1, n + 1)]
    total = sum(weights)
    return [w / total for w in accumulate(weights)]


def _draw(cdf: list[float], rng: random.Random) -> int:
    return min(bisect_left(cdf, rng.random()), len(cdf) - 1)


def generate_mmlu_trace(
    mmlu_dir: Path,
    tok: Tokenizer,
    *,
    n_requests: int = 10_000,
    alpha: float = 1.0,
    rate: float = 4.0,
    seed: int = 0,
    split: str = "test",
    use_cache: bool = True,
    max_tokens: int = 1,
) -> Workload:
    """An MMLU 5-shot trace: Zipf(alpha) subject popularity, Poisson(rate) arrivals."""
    dev_dir = mmlu_dir / "data" / "dev"
    q_dir = mmlu_dir / "data" / split
    if not dev_dir.is_dir() or not q_dir.is_dir():
        raise WorkloadError(f"no MMLU data under {mmlu_dir} (need data/dev and data/{split})")
    subjects = sorted(p.name[: -len("_dev.csv")] for p in dev_dir.glob("*_dev.csv"))

    def build() -> list[tuple]:
        rng = random.Random(seed)
        ranking = subjects[:]
        rng.shuffle(ranking)
        cdf = zipf_cdf(len(ranking), alpha)
        prefixes: dict[str, str] = {}
        questions: dict[str, list[list[str]]] = {}
        rows, t = [], 0.0
        for _ in range(n_requests):
            t += rng.expovariate(rate)
            subj = ranking[_draw(cdf, rng)]
            if subj not in prefixes:
                header = (
                    "The following are multiple choice questions (with answers) about "
                    f"{subj.replace('_', ' ')}.\n\n"
                )
                dev = _read_mmlu_csv(dev_dir / f"{subj}_dev.csv")[:5]
                prefixes[subj] = header + "".join(_mmlu_item(r, True) for r in dev)
                questions[subj] = _read_mmlu_csv(q_dir / f"{subj}_{split}.csv")
            qs = questions[subj]
            text = prefixes[subj] + _mmlu_item(qs[rng.randrange(len(qs))], False)
            rows.append((round(t, 4), _arr(tok.encode(text)), max_tokens, subj))
        return rows

    key = {
        "kind": "mmlu-gen", "n": n_requests, "alpha": alpha, "rate": rate, "seed": seed,
        "split": split, "tok": tok.name, "mt": max_tokens,
        "src": hashlib.sha256("".join(subjects).encode()).hexdigest(),
    }  # fmt: skip
    rows = _cached(key, build, use_cache)
    meta = {"alpha": alpha, "rate": rate, "seed": seed, "source": str(mmlu_dir)}
    return _rows_to_workload(f"mmlu-gen(alpha={alpha})", rows, tok.name, meta)


def load_sharegpt(
    path: Path,
    tok: Tokenizer,
    *,
    n_requests: int | None = None,
    rate: float = 4.0,
    think_s: float = 20.0,
    max_output: int = 128,
    seed: int = 0,
    use_cache: bool = True,
) -> Workload:
    """ShareGPT multi-turn conversations expanded into one chat request per round."""

    def build() -> list[tuple]:
        rng = random.Random(seed)
        convs = []
        n_total = 0
        with _open_text(path) as fh:
            for line in fh:
                if not line.strip():
                    continue
                d = json.loads(line)
                rounds = d["rounds"]
                convs.append(rounds)
                n_total += len(rounds)
                if n_requests is not None and n_total >= n_requests:
                    break
        mean_rounds = n_total / max(1, len(convs))
        conv_rate = rate / mean_rounds
        rows, t0 = [], 0.0
        for ci, rounds in enumerate(convs):
            t0 += rng.expovariate(conv_rate)
            t = t0
            history: list[dict[str, str]] = []
            for r in rounds:
                msgs = history + [{"role": "user", "content": r["user"]}]
                toks = tok.encode(render_chatml(msgs))
                out = min(max_output, max(1, len(tok.encode(r.get("assistant", "")))))
                rows.append((round(t, 4), _arr(toks), out, f"conv{ci}"))
                history = msgs + [{"role": "assistant", "content": r.get("assistant", "")}]
                t += rng.expovariate(1.0 / think_s)
        rows.sort(key=lambda r: r[0])
        return rows[:n_requests] if n_requests is not None else rows

    key = {
        "kind": "sharegpt", "src": _file_digest(path), "tok": tok.name, "n": n_requests,
        "rate": rate, "think": think_s, "maxout": max_output, "seed": seed,
    }  # fmt: skip
    rows = _cached(key, build, use_cache)
    return _rows_to_workload("sharegpt", rows, tok.name, {"source": str(path), "rate": rate})


def load_generic(path: Path, tok: Tokenizer, *, use_cache: bool = True) -> Workload:
    """The documented generic format (see the module docstring)."""

    def build() -> list[tuple]:
        rows = []
        with _open_text(path) as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                    arrival = float(d["arrival_s"])
                    if "prompt" in d:
                        text = str(d["prompt"])
                    elif "messages" in d:
                        text = render_chatml(d["messages"])
                    else:
                        raise KeyError("prompt or messages")
                    mt = int(d.get("max_tokens", _DEFAULT_MAX_TOKENS))
                except (ValueError, KeyError, TypeError) as exc:
                    raise WorkloadError(f"{path}:{lineno}: bad request line ({exc})") from exc
                if not math.isfinite(arrival) or arrival < 0 or mt < 1:
                    raise WorkloadError(f"{path}:{lineno}: arrival_s must be >= 0, max_tokens >= 1")
                rows.append((arrival, _arr(tok.encode(text)), mt, str(d.get("group", ""))))
        if not rows:
            raise WorkloadError(f"{path}: no requests")
        return rows

    key = {"kind": "generic", "src": _file_digest(path), "tok": tok.name}
    rows = _cached(key, build, use_cache)
    return _rows_to_workload(path.name, rows, tok.name, {"source": str(path)})


def synthetic_workload(
    n_requests: int = 2000,
    *,
    rate: float = 1.0,
    alpha: float = 1.0,
    n_system: int = 8,
    n_docs: int = 200,
    followup_p: float = 0.3,
    max_tokens: int = 32,
    seed: int = 0,
    vocab: int = 50_000,
) -> Workload:
    """Shared system prompts + Zipf-popular documents + multi-turn follow-ups, as token ids.

    A new session's prompt is ``system[s] + document[d] + question`` with ``s`` and ``d``
    Zipf(alpha)-popular; with probability ``followup_p`` a request instead continues one of
    the 64 most recent sessions: its previous prompt + an answer + a new question.
    """
    rng = random.Random(seed)

    def seq(lo: int, hi: int) -> tuple[int, ...]:
        return tuple(rng.randrange(vocab) for _ in range(rng.randint(lo, hi)))

    systems = [seq(150, 400) for _ in range(n_system)]
    docs = [seq(200, 1200) for _ in range(n_docs)]
    sys_cdf, doc_cdf = zipf_cdf(n_system, alpha), zipf_cdf(n_docs, alpha)
    recent: list[tuple[int, ...]] = []
    reqs: list[Request] = []
    t = 0.0
    for i in range(n_requests):
        t += rng.expovariate(rate)
        if recent and rng.random() < followup_p:
            j = rng.randrange(len(recent))
            tokens = recent[j] + seq(20, 120) + seq(10, 60)
            recent[j] = tokens
        else:
            tokens = systems[_draw(sys_cdf, rng)] + docs[_draw(doc_cdf, rng)] + seq(10, 60)
            recent.append(tokens)
            if len(recent) > 64:
                recent.pop(0)
        reqs.append(Request(i, t, tokens, max_tokens, ""))
    meta = {"alpha": alpha, "rate": rate, "seed": seed}
    return Workload(f"synthetic(alpha={alpha})", reqs, "synthetic", meta)


# ------------------------------------------------------------------------ dispatch


def _detect(path: Path) -> str:
    with _open_text(path) as fh:
        for line in fh:
            if line.strip():
                try:
                    d = json.loads(line)
                except ValueError as exc:
                    raise WorkloadError(f"{path}: first line is not JSON") from exc
                if "prompt_prefix" in d:
                    return "mmlu"
                if "rounds" in d:
                    return "sharegpt"
                return "generic"
    raise WorkloadError(f"{path}: empty workload file")


def load_workload(
    spec: str,
    *,
    n_requests: int | None = None,
    shared: str | os.PathLike | None = None,
    tokenizer: str | Tokenizer = "auto",
    alpha: float | None = None,
    rate: float | None = None,
    seed: int = 0,
    use_cache: bool = True,
) -> Workload:
    """Load a workload by name (``mmlu``, ``mmlu-gen``, ``sharegpt``, ``synthetic``) or path.

    ``n_requests`` keeps the first n requests. ``alpha``/``rate`` apply to generated
    workloads (``mmlu-gen``, ``synthetic``, ``sharegpt`` arrivals); for ``mmlu`` with an
    ``alpha`` other than the trace's 1.0, ``mmlu-gen`` is used instead.
    """
    if spec == "synthetic":
        return synthetic_workload(
            n_requests or 2000,
            rate=rate if rate is not None else 1.0,
            alpha=alpha if alpha is not None else 1.0,
            seed=seed,
        )
    tok = tokenizer if not isinstance(tokenizer, str) else load_tokenizer(tokenizer)
    root = shared_dir(shared) / "workloads"
    if spec == "mmlu" and (alpha not in (None, 1.0) or rate not in (None, 4.0) or seed != 0):
        spec = "mmlu-gen"
    if spec == "mmlu-gen":
        return generate_mmlu_trace(
            root / "mmlu", tok, n_requests=n_requests or 10_000,
            alpha=alpha if alpha is not None else 1.0, rate=rate if rate is not None else 4.0,
            seed=seed, use_cache=use_cache,
        )  # fmt: skip
    if spec == "mmlu":
        path = root / "mmlu_zipf_trace.jsonl.gz"
    elif spec == "sharegpt":
        path = root / "sharegpt_multiturn.jsonl.gz"
    else:
        path = Path(spec).expanduser()
    if not path.is_file():
        raise WorkloadError(
            f"workload file not found: {path} (set --shared-dir or PREFIXMESH_SHARED_DIR, "
            "or use --workload synthetic)"
        )
    kind = _detect(path)
    if kind == "mmlu":
        wl = load_mmlu_trace(path, tok, use_cache=use_cache)
    elif kind == "sharegpt":
        wl = load_sharegpt(
            path, tok, n_requests=n_requests, rate=rate if rate is not None else 4.0,
            seed=seed, use_cache=use_cache,
        )  # fmt: skip
    else:
        wl = load_generic(path, tok, use_cache=use_cache)
    return wl.head(n_requests) if n_requests is not None else wl
