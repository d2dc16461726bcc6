"""Fuzzing every decoder that reads bytes from a peer or from disk.

Usage::

    python -m prefixmesh.bench.fuzz --decoder digest --count 100000
    python -m prefixmesh.bench.fuzz --decoder all --count 100000 --json results.json
    python -m prefixmesh.bench.fuzz --list

For each decoder (a :class:`Target`) the loop draws inputs from three generators and
feeds each one to the decoder:

- plain random bytes (10 %);
- byte-level mutations of a pool of valid encodings plus every interesting input found
  so far (45 %): bit flips, "interesting" bytes, insertions, deletions, truncation,
  duplicated slices, splices of two inputs, CBOR length heads inflated to 2^32-1 or
  2^64-1, big-endian/little-endian integers overwritten with boundary values, deep
  nesting prefixes;
- structure-aware mutations (45 %): the input is parsed (CBOR / JSON / TOML / the KV
  file header), one node of the tree is replaced with a value of another type or a
  boundary value, deleted, duplicated or wrapped in deep nesting, and the result is
  re-encoded: canonically most of the time (so it gets past the canonical-encoding
  check into the schema checks), otherwise with reordered or duplicated map keys,
  non-minimal heads, indefinite lengths or tags. Signed records are *re-signed* after
  mutation with the fuzzer's own key (any peer can sign garbage with its own key), so
  the field checks behind the signature check are exercised too.

Every input must either decode or raise the target's typed error; anything else (another
exception type, more than ``--hang-s`` seconds) is a bug. Inputs that show a new error
class, a new exception type or that take more than ``--slow-s`` are saved to
``tests/fuzz_corpus/<decoder>/`` (the regular test suite replays that folder) and join
the mutation pool. Memory: every ``--mem-every``-th input, and a few crafted worst cases
per decoder (the largest inputs its limits allow), run under ``tracemalloc``; the report
gives the peak.

The targets are shared with ``tests/bench/test_fuzz_decoders.py``. No trio, libp2p or llama
imports (``load_config`` may import the model module's cache-dir helper).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import hashlib
import json
import math
import os
import random
import re
import shutil
import signal
import struct
import sys
import tempfile
import time
import tracemalloc
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cbor2

__all__ = [
    "Target",
    "TARGET_NAMES",
    "MISSING_TARGETS",
    "get_target",
    "available_targets",
    "generate",
    "run_one",
    "run_fuzz",
    "DEFAULT_CORPUS",
    "MAX_CASE_BYTES",
    "FuzzHang",
    "time_limit",
]

DEFAULT_CORPUS = Path(__file__).resolve().parent.parent / "tests" / "fuzz_corpus"
MAX_CASE_BYTES = 64 * 1024  # larger interesting inputs are reported, not saved
NOW = 1_700_000_000.0  # the fixed clock every time-dependent decoder is given
FUZZ_SEED = bytes(range(1, 33))  # the fuzzer's own Ed25519 identity (signs mutated records)
MODEL_FP = b"\x11" * 32

#: decoders named in issue 7 that do not exist yet (name -> why)
MISSING_TARGETS: dict[str, str] = {}


class FuzzHang(Exception):
    """Raised by :func:`time_limit` when one input runs past its budget."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`FuzzHang` in the main thread after ``seconds`` (SIGALRM timer)."""

    def on_alarm(signum, frame):  # noqa: ARG001
        raise FuzzHang(f"input ran longer than {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ---------------------------------------------------------------------------- targets


@dataclass
class Target:
    """One decoder under fuzz."""

    name: str
    what: str  # the function(s) fuzzed, for reports
    errors: tuple[type[BaseException], ...]  # the typed errors it may raise
    run: Callable[[bytes], object]
    seeds: list[bytes]
    structured: Callable[[random.Random, bytes], bytes | None] | None = None
    crafted: list[tuple[str, bytes]] = field(default_factory=list)  # worst cases (memory)
    # peak traced memory allowed for an input of n bytes (checked on the crafted cases);
    # each target sets ~2-4x what was measured, so a regression shows, noise does not
    mem_bound: Callable[[int], int] = lambda n: 64 * n + (4 << 20)
    max_random_len: int = 4096
    cbor: bool = False
    nest_open: bytes = b""  # one nesting level's opening bytes (deep-nesting mutation)
    nest_close: bytes = b""


_TARGETS: dict[str, Target] = {}
_BUILDERS: dict[str, Callable[[], Target]] = {}


def _builder(name: str):
    def deco(fn):
        _BUILDERS[name] = fn
        return fn

    return deco


def get_target(name: str) -> Target:
    """The target ``name`` (built on first use; raises ImportError if its module is broken)."""
    if name not in _TARGETS:
        _TARGETS[name] = _BUILDERS[name]()
    return _TARGETS[name]


def available_targets() -> tuple[dict[str, Target], dict[str, str]]:
    """(targets that build, {name: why not} for those that don't or don't exist)."""
    ok: dict[str, Target] = {}
    missing = dict(MISSING_TARGETS)
    for name in _BUILDERS:
        try:
            ok[name] = get_target(name)
        except Exception as exc:  # a module under construction by its owner
            missing[name] = f"{type(exc).__name__}: {exc}"
    return ok, missing


_tmpdir: Path | None = None


def _scratch() -> Path:
    """A private scratch folder (tmpfs when available) for file-based decoders."""
    global _tmpdir
    if _tmpdir is None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        _tmpdir = Path(tempfile.mkdtemp(prefix="pm-fuzz-", dir=base))
        atexit.register(shutil.rmtree, _tmpdir, ignore_errors=True)
    return _tmpdir


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- values


_INTS = [
    0,
    1,
    -1,
    23,
    24,
    255,
    256,
    65535,
    65536,
    2**31 - 1,
    2**32 - 1,
    2**32,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64 - 1,
    -(2**63),
    -(2**64),
]
_FLOATS = [
    0.0,
    -0.0,
    1.0,
    -1.0,
    0.5,
    1e-300,
    5e-324,
    1e300,
    1.7976931348623157e308,
    math.inf,
    -math.inf,
    math.nan,
    65504.0,
    1e12,
    1e11 + 1,
]


def _rand_text(rng: random.Random, n: int) -> str:
    pool = "abc/:.-_ 0123456789\x00\n\"'\\[]{}=#é中😀\u202e"
    return "".join(rng.choice(pool) for _ in range(n))


def _rand_value(rng: random.Random, depth: int = 0, *, json_only: bool = False) -> Any:
    """A random value of a random type (JSON/TOML-compatible types when ``json_only``)."""
    kinds = ["int", "bigint", "float", "text", "bool", "list", "dict"]
    if not json_only:
        kinds += ["bytes", "none", "bytes"]
    else:
        kinds += ["none"]
    if depth > 3:
        kinds = [k for k in kinds if k not in ("list", "dict")]
    k = rng.choice(kinds)
    if k == "int":
        return rng.choice(_INTS) if rng.random() < 0.7 else rng.randint(-1000, 1000)
    if k == "bigint":
        return rng.choice([2**64, -(2**64) - 1, 10**40, 10 ** rng.choice([20, 400, 4400]) - 1])
    if k == "float":
        return rng.choice(_FLOATS) if rng.random() < 0.7 else rng.uniform(-1e6, 1e6)
    if k == "text":
        return _rand_text(rng, rng.choice([0, 1, 8, 40, 300, 3000]))
    if k == "bytes":
        return rng.randbytes(rng.choice([0, 1, 7, 8, 9, 32, 38, 64, 600]))
    if k == "bool":
        return rng.random() < 0.5
    if k == "none":
        return None
    if k == "list":
        return [_rand_value(rng, depth + 1, json_only=json_only) for _ in range(rng.randint(0, 4))]
    return {
        _rand_text(rng, rng.randint(1, 3)): _rand_value(rng, depth + 1, json_only=json_only)
        for _ in range(rng.randint(0, 4))
    }


def _thaw(obj: Any) -> Any:
    """Decoded CBOR -> mutable Python (frozendict keys/tuples become plain containers)."""
    if isinstance(obj, dict):
        return {k: _thaw(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_thaw(v) for v in obj]
    return obj


def _paths(obj: Any, prefix: tuple = (), depth: int = 0) -> list[tuple]:
    out = [prefix]
    if depth > 12:
        return out
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,), depth + 1)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, prefix + (i,), depth + 1)
    return out


def _get(obj: Any, path: tuple) -> Any:
    for p in path:
        obj = obj[p]
    return obj


def mutate_tree(rng: random.Random, obj: Any, *, json_only: bool = False) -> Any:
    """One structural mutation of a decoded tree (the tree is modified and returned)."""
    paths = _paths(obj)
    path = rng.choice(paths)
    op = rng.randrange(8)
    if not path:  # the root
        if op < 2:
            return [obj]
        if op < 3:
            return _rand_value(rng, json_only=json_only)
        path = rng.choice(paths)
        if not path:
            return _rand_value(rng, json_only=json_only)
    parent, key = _get(obj, path[:-1]), path[-1]
    if op <= 2:  # replace with another type / boundary value
        parent[key] = _rand_value(rng, json_only=json_only)
    elif op == 3:  # delete
        del parent[key]
    elif op == 4:  # duplicate / extra entry
        if isinstance(parent, list):
            parent.insert(key, parent[key])
        else:
            parent[_rand_text(rng, rng.randint(1, 2))] = parent[key]
    elif op == 5:  # wrap in deep nesting
        v = parent[key]
        for _ in range(rng.choice([2, 10, 60])):
            v = [v]
        parent[key] = v
    elif op == 6:  # numeric nudge / string growth
        v = parent[key]
        if isinstance(v, bool):
            parent[key] = not v
        elif isinstance(v, int):
            parent[key] = v + rng.choice([-1, 1, -(2**63), 2**63, 2**64])
        elif isinstance(v, float):
            parent[key] = rng.choice([v * 10 ** rng.randint(1, 300), -v, math.nan, math.inf])
        elif isinstance(v, str | bytes):
            parent[key] = v * rng.choice([0, 2, 50]) if v else v + v[:0]
        elif isinstance(v, list):
            parent[key] = v * rng.choice([0, 2, 100])
        else:
            parent[key] = _rand_value(rng, json_only=json_only)
    else:  # swap with another node of the tree
        other = rng.choice(paths)
        if other and not (other[: len(path)] == path or path[: len(other)] == other):
            other_parent = _get(obj, other[:-1])
            parent[key], other_parent[other[-1]] = other_parent[other[-1]], parent[key]
    return obj


# ---------------------------------------------------------------------------- CBOR writer


def _head(major: int, n: int, rng: random.Random | None) -> bytes:
    if rng is not None and rng.random() < 0.3:  # non-minimal head
        width = rng.choice([1, 2, 4, 8])
        if n < 1 << (8 * width):
            info = {1: 24, 2: 25, 4: 26, 8: 27}[width]
            return bytes([major << 5 | info]) + n.to_bytes(width, "big")
    if n < 24:
        return bytes([major << 5 | n])
    for info, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * width):
            return bytes([major << 5 | info]) + n.to_bytes(width, "big")
    raise ValueError("CBOR argument too large")


def cbor_weird(obj: Any, rng: random.Random, depth: int = 0) -> bytes:
    """Encode ``obj`` as CBOR with random non-canonical choices (key order, duplicates,
    non-minimal heads, indefinite lengths, tags)."""
    r = rng if rng.random() < 0.2 else None
    if rng.random() < 0.02:
        return _head(6, rng.choice([0, 1, 2, 24, 55799]), None) + cbor_weird(obj, rng, depth + 1)
    if obj is None or isinstance(obj, bool) or isinstance(obj, float):
        if isinstance(obj, float) and rng.random() < 0.2:
            return b"\xfb" + struct.pack(">d", obj)  # non-shortest float
        return cbor2.dumps(obj)
    if isinstance(obj, int):
        if -(2**64) <= obj < 2**64:
            return _head(0, obj, r) if obj >= 0 else _head(1, -1 - obj, r)
        return cbor2.dumps(obj)
    if isinstance(obj, bytes | str):
        major = 2 if isinstance(obj, bytes) else 3
        raw = obj if isinstance(obj, bytes) else obj.encode("utf-8", "surrogatepass")
        if rng.random() < 0.03 and raw:
            cut = rng.randrange(len(raw) + 1)
            return (
                bytes([major << 5 | 31])
                + _head(major, cut, None)
                + raw[:cut]
                + _head(major, len(raw) - cut, None)
                + raw[cut:]
                + b"\xff"
            )
        return _head(major, len(raw), r) + raw
    if isinstance(obj, list | tuple):
        items = b"".join(cbor_weird(v, rng, depth + 1) for v in obj)
        if rng.random() < 0.03:
            return b"\x9f" + items + b"\xff"
        return _head(4, len(obj), r) + items
    if isinstance(obj, dict):
        pairs = [
            (cbor_weird(k, rng, depth + 1), cbor_weird(v, rng, depth + 1)) for k, v in obj.items()
        ]
        if pairs and rng.random() < 0.3:
            pairs.append(rng.choice(pairs))  # duplicated key
        if rng.random() < 0.5:
            rng.shuffle(pairs)  # reordered keys
        return _head(5, len(pairs), r) + b"".join(k + v for k, v in pairs)
    return cbor2.dumps(obj)


def cbor_encode(obj: Any, rng: random.Random) -> bytes:
    """Canonical CBOR 70 % of the time (falls back to weird for unencodable trees)."""
    if rng.random() < 0.7:
        try:
            return cbor2.dumps(obj, canonical=True)
        except Exception:  # noqa: S110 - e.g. an unhashable key after a mutation
            pass
    try:
        return cbor_weird(obj, rng)
    except Exception:
        return cbor2.dumps(None)


def _cbor_load(data: bytes) -> Any | None:
    try:
        return _thaw(cbor2.loads(data))
    except Exception:
        return None


def _cbor_structured(rng: random.Random, data: bytes) -> bytes | None:
    obj = _cbor_load(data)
    if obj is None:
        return None
    for _ in range(rng.choice([1, 1, 2, 3])):
        obj = mutate_tree(rng, obj)
    return cbor_encode(obj, rng)


# ---------------------------------------------------------------------------- byte mutation

_INTERESTING_BYTES = [
    0x00,
    0x01,
    0x17,
    0x18,
    0x1B,
    0x1F,
    0x20,
    0x3F,
    0x40,
    0x5F,
    0x60,
    0x7F,
    0x80,
    0x9F,
    0xA0,
    0xBF,
    0xC0,
    0xD8,
    0xF4,
    0xF7,
    0xF8,
    0xF9,
    0xFB,
    0xFF,
]
_BOUNDARY_U32 = [0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 512 * 1024, 512 * 1024 + 1]
_BOUNDARY_U64 = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, 1 << 20, (1 << 20) + 1]


def mutate_bytes(rng: random.Random, data: bytes, pool: list[bytes], target: Target) -> bytes:
    """1-4 random byte-level edits of ``data``."""
    buf = bytearray(data)
    for _ in range(rng.choice([1, 1, 2, 3, 4])):
        op = rng.randrange(12)
        n = len(buf)
        if op == 0 and n:  # bit flip
            i = rng.randrange(n)
            buf[i] ^= 1 << rng.randrange(8)
        elif op == 1 and n:  # interesting byte
            buf[rng.randrange(n)] = rng.choice(_INTERESTING_BYTES)
        elif op == 2:  # insert random bytes
            i = rng.randrange(n + 1)
            buf[i:i] = rng.randbytes(rng.randint(1, 16))
        elif op == 3 and n:  # delete a range
            i = rng.randrange(n)
            del buf[i : i + rng.randint(1, 32)]
        elif op == 4 and n:  # truncate
            del buf[rng.randrange(n) :]
        elif op == 5 and n:  # duplicate a slice
            i = rng.randrange(n)
            j = min(n, i + rng.randint(1, 64))
            k = rng.randrange(n + 1)
            buf[k:k] = buf[i:j] * rng.choice([1, 2, 8])
        elif op == 6 and pool:  # splice with another input
            other = rng.choice(pool)
            i, j = rng.randrange(n + 1), rng.randrange(len(other) + 1)
            buf = buf[:i] + bytearray(other[j:])
        elif op == 7 and n and target.cbor:  # inflate a CBOR length head
            starts = [i for i in range(min(n, 4096)) if 2 <= buf[i] >> 5 <= 5]
            if starts:
                i = rng.choice(starts)
                major = buf[i] >> 5
                big = rng.choice(
                    [
                        b"\x1a\xff\xff\xff\xff",
                        b"\x1b" + b"\xff" * 8,
                        b"\x1b\x7f" + b"\xff" * 7,
                        b"\x19\xff\xff",
                    ]
                )
                buf[i : i + 1] = bytes([major << 5 | big[0]]) + big[1:]
        elif op == 8 and n >= 4:  # boundary u32 (big and little endian)
            i = rng.randrange(n - 3)
            v = rng.choice(_BOUNDARY_U32)
            buf[i : i + 4] = v.to_bytes(4, rng.choice(["big", "little"]))
        elif op == 9 and n >= 8:  # boundary u64
            i = rng.randrange(n - 7)
            buf[i : i + 8] = rng.choice(_BOUNDARY_U64).to_bytes(8, rng.choice(["big", "little"]))
        elif op == 10 and target.nest_open:  # deep nesting
            depth = rng.choice([10, 100, 1000, 5000])
            buf = bytearray(target.nest_open * depth + bytes(buf) + target.nest_close * depth)
        elif op == 11 and n:  # overwrite a range with random bytes
            i = rng.randrange(n)
            buf[i : i + 8] = rng.randbytes(min(8, n - i))
    return bytes(buf)


def generate(rng: random.Random, target: Target, pool: list[bytes] | None = None) -> bytes:
    """One fuzz input for ``target``: random, byte-mutated or structure-mutated."""
    pool = pool or target.seeds
    r = rng.random()
    if r < 0.10:
        return rng.randbytes(rng.randint(0, target.max_random_len))
    base = rng.choice(pool)
    if r < 0.55 or target.structured is None:
        return mutate_bytes(rng, base, pool, target)
    try:
        out = target.structured(rng, base)
    except RecursionError:  # a mutated tree nested too deep for our own writers
        out = None
    if out is None:
        return mutate_bytes(rng, base, pool, target)
    if rng.random() < 0.2:
        out = mutate_bytes(rng, out, pool, target)
    return out


# ---------------------------------------------------------------------------- digest


def _fuzz_identity():
    from prefixmesh.overlay.core.identity import Identity

    return Identity.from_seed(FUZZ_SEED)


def _records(n_variants: int = 6) -> list[Any]:
    """Valid signed records of assorted shapes from the fuzz identity."""
    from prefixmesh.overlay.core.digest import (
        KIND_DELTA,
        KIND_SNAPSHOT,
        DigestRecord,
        LoadFigures,
        NamespaceDelta,
        sign_record,
    )

    ident = _fuzz_identity()
    rng = random.Random(1)

    def hashes(k: int) -> tuple[bytes, ...]:
        return tuple(sorted({rng.randbytes(8) for _ in range(k)}))

    shapes = [
        (KIND_SNAPSHOT, [(b"\x01" * 8, hashes(12), ())], ("/ip4/10.0.0.1/tcp/4001",)),
        (KIND_DELTA, [(b"\x01" * 8, hashes(3), hashes(2))], ()),
        (KIND_DELTA, [], ()),
        (
            KIND_SNAPSHOT,
            [(bytes([i]) * 8, hashes(5), ()) for i in range(1, 5)],
            ("/ip4/10.0.0.1/tcp/4001", "/ip6/::1/tcp/4001", "/dns4/example.org/tcp/1"),
        ),
        (KIND_DELTA, [(b"\x02" * 8, (), hashes(6))], ()),
        (KIND_SNAPSHOT, [(b"\x03" * 8, hashes(400), ())], ()),
    ][:n_variants]
    out = []
    for seq, (kind, nss, addrs) in enumerate(shapes):
        rec = DigestRecord(
            origin=ident.peer_id,
            epoch=3,
            seq=seq,
            issued_at=NOW - 1.0,
            expires_at=NOW + 59.0,
            model=MODEL_FP,
            kind=kind,
            namespaces=tuple(NamespaceDelta(ns, a, r) for ns, a, r in nss),
            load=LoadFigures(2, 1, 450.0, 120.5),
            kv_capacity_bytes=1 << 30,
            kv_used_bytes=12345,
            addrs=addrs,
        )
        out.append(sign_record(rec, ident))
    return out


def _resign(body: bytes) -> bytes:
    from prefixmesh.overlay.core.digest import RECORD_VERSION, SIGNATURE_LABEL

    ident = _fuzz_identity()
    sig = ident.sign(SIGNATURE_LABEL + body)
    return cbor2.dumps([RECORD_VERSION, body, ident.public_bytes, sig], canonical=True)


def _digest_structured(rng: random.Random, data: bytes) -> bytes | None:
    env = _cbor_load(data)
    if not isinstance(env, list) or len(env) != 4 or not isinstance(env[1], bytes):
        return _cbor_structured(rng, data)
    if rng.random() < 0.75:  # mutate the body, then sign it properly
        body = _cbor_load(env[1])
        if body is None:
            return None
        for _ in range(rng.choice([1, 1, 2])):
            body = mutate_tree(rng, body)
        return _resign(cbor_encode(body, rng))
    return cbor_encode(mutate_tree(rng, env), rng)


@_builder("digest")
def _digest_target() -> Target:
    from prefixmesh.overlay.core.digest import MAX_RECORD_BYTES, DigestError, decode_record

    seeds = [r.raw for r in _records()]

    def run(data: bytes) -> object:
        return decode_record(data, now=NOW)

    # worst cases the limits allow: a maximal byte string, a maximal flat array
    crafted = [
        (
            "max-bytes",
            b"\x5a" + (MAX_RECORD_BYTES - 5).to_bytes(4, "big") + b"\x00" * (MAX_RECORD_BYTES - 5),
        ),
        (
            "max-array",
            b"\x9a" + (MAX_RECORD_BYTES - 5).to_bytes(4, "big") + b"\x00" * (MAX_RECORD_BYTES - 5),
        ),
        ("nested-8", b"\x81" * 8 + b"\x00"),
        ("signed-max-hash-list", _resign(_max_hash_body())),
    ]
    return Target(
        "digest",
        "overlay.digest.decode_record",
        (DigestError,),
        run,
        seeds,
        structured=_digest_structured,
        crafted=crafted,
        cbor=True,
        nest_open=b"\x81",
        max_random_len=2048,
        mem_bound=lambda n: 16 * n + (4 << 20),
    )


def _max_hash_body() -> bytes:
    """A body whose namespace list holds the most hashes a record may carry."""
    from prefixmesh.overlay.core.digest import MAX_HASHES_PER_RECORD

    ident = _fuzz_identity()
    hashes = b"".join(struct.pack(">Q", i) for i in range(MAX_HASHES_PER_RECORD))
    body = {
        "o": ident.peer_id,
        "e": 1,
        "s": 1,
        "i": NOW - 1,
        "x": NOW + 59,
        "m": MODEL_FP,
        "k": 1,
        "n": [[b"\x01" * 8, hashes, b""]],
        "l": [0, 0, 1.0, 1.0],
        "c": 1,
        "u": 0,
        "a": [],
    }
    return cbor2.dumps(body, canonical=True)


# ---------------------------------------------------------------------------- anti-entropy


@_builder("antientropy")
def _antientropy_target() -> Target:
    from prefixmesh.overlay.core.antientropy import AntiEntropy
    from prefixmesh.overlay.core.exchange import (
        MAX_MESSAGE_BYTES,
        AntiEntropyError,
        ScopedSummary,
        decode_buckets,
        decode_records,
        decode_reply,
        decode_scoped_summary,
        decode_summary,
        decode_summary_hash,
        encode_buckets,
        encode_records,
        encode_reply,
        encode_scoped_summary,
        encode_summary,
        encode_summary_hash,
        peek_message_type,
    )
    from prefixmesh.overlay.core.identity import Identity

    records = _records()
    ident = _fuzz_identity()
    summary = {ident.peer_id: (3, 5), Identity.from_seed(b"\x07" * 32).peer_id: (0, 0)}
    seeds = [
        encode_summary(summary),
        encode_summary({}),
        encode_reply(records[:3], summary, [ident.peer_id]),
        encode_reply([], {}, []),
        encode_records(records),
        encode_records(records[:1]),
        # the hash-first opener and bucketed summaries (messages 0, 7-8)
        encode_summary_hash(b"\x01" * 16),
        encode_summary_hash(False),
        encode_buckets([1, 2, 3, 0xFFFFFFFF]),
        encode_scoped_summary(ScopedSummary(4, (0, 3), summary)),
    ]
    local = Identity.from_seed(b"\x09" * 32)
    # the decoders that keep records last: what they return stays alive while the
    # remaining decoders parse the same message (peak memory is bounded per target)
    decoders = (decode_summary_hash, decode_buckets, decode_scoped_summary, decode_summary,
                decode_reply, decode_records)

    class ReceiveRaised(Exception):
        """AntiEntropy.receive must report rejections, never raise."""

    def run(data: bytes) -> object:
        raws = None
        errors: list[AntiEntropyError] = []
        peek_message_type(data)  # must never raise (it picks the decoder in gossip.py)
        for decode in decoders:
            try:
                out = decode(data)
            except AntiEntropyError as exc:
                # without its traceback: the frames would keep each decoder's parse alive
                errors.append(exc.with_traceback(None))
                continue
            if decode is decode_reply:
                raws = out.records
            elif decode is decode_records:
                raws = out
        if len(errors) == len(decoders):  # none took it: report the most specific refusal
            raise next((e for e in errors if "expected message type" not in str(e)), errors[0])
        if raws:
            ae = AntiEntropy(local, MODEL_FP, epoch=1, now=NOW)
            try:
                ae.receive(raws[:16], NOW)
            except Exception as exc:
                raise ReceiveRaised(f"receive raised {type(exc).__name__}: {exc}") from exc
        return raws

    def structured(rng: random.Random, data: bytes) -> bytes | None:
        msg = _cbor_load(data)
        if not isinstance(msg, list):
            return None
        raws_at = [
            i
            for i, v in enumerate(msg)
            if isinstance(v, list) and v and all(isinstance(x, bytes) and len(x) > 100 for x in v)
        ]
        if raws_at and rng.random() < 0.5:  # mutate (and re-sign) one embedded record
            lst = msg[rng.choice(raws_at)]
            j = rng.randrange(len(lst))
            lst[j] = _digest_structured(rng, lst[j]) or lst[j]
            return cbor_encode(msg, rng)
        return cbor_encode(mutate_tree(rng, msg), rng)

    n = MAX_MESSAGE_BYTES
    crafted = [
        # the most items a message's byte budget allows, in each decoder's lists
        ("summary-8MiB-of-zeros", b"\x82\x01\x9a" + (n - 7).to_bytes(4, "big") + b"\x00" * (n - 7)),
        (
            "records-8MiB-of-empty-bytes",
            b"\x82\x03\x9a" + (n - 7).to_bytes(4, "big") + b"\x40" * (n - 7),
        ),
        (
            "records-most-max-records",
            encode_records([records[-1]] * min(4096, (n - 16) // (len(records[-1].raw) + 3))),
        ),
    ]
    return Target(
        "antientropy",
        "overlay.core.exchange: every message decoder (0-3, 7-8), peek_message_type + AntiEntropy.receive",
        (AntiEntropyError,),
        run,
        seeds,
        structured=structured,
        crafted=crafted,
        cbor=True,
        nest_open=b"\x81",
        max_random_len=4096,
        mem_bound=lambda n: 4 * n + (16 << 20),
    )


# ---------------------------------------------------------------------------- partition


@_builder("partition")
def _partition_target() -> Target:
    from prefixmesh.overlay.core.digest import LoadFigures
    from prefixmesh.overlay.core.partition import (
        MAX_PARTITION_MESSAGE_BYTES,
        HolderMatch,
        PartitionMessageError,
        decode_ack,
        decode_lookup,
        decode_lookup_answer,
        decode_push,
        encode_ack,
        encode_lookup,
        encode_lookup_answer,
        encode_push,
    )

    records = _records()
    ident = _fuzz_identity()
    load = LoadFigures(2, 1, 420.0, 120.0)
    seeds = [
        encode_push(7, [r.raw for r in records[:3]]),
        encode_push(0, []),
        encode_ack(7, {ident.peer_id: (1, 4)}),
        encode_ack(65535, {}),
        encode_lookup(3, b"n" * 8, [bytes([i]) * 8 for i in range(12)]),
        encode_lookup_answer([HolderMatch(ident.peer_id, 4, load, NOW + 60.0)] * 3),
        encode_lookup_answer([]),
    ]
    decoders = (decode_push, decode_ack, decode_lookup, decode_lookup_answer)

    def run(data: bytes) -> object:
        errors: list[PartitionMessageError] = []
        out = None
        for decode in decoders:
            try:
                out = decode(data)
            except PartitionMessageError as exc:
                errors.append(exc.with_traceback(None))
        if len(errors) == len(decoders):
            raise errors[0]
        return out

    n = MAX_PARTITION_MESSAGE_BYTES
    crafted = [
        ("push-1MiB-of-empty-bytes",
         b"\x83\x14\x01\x9a" + (n - 8).to_bytes(4, "big") + b"\x40" * (n - 8)),
        ("lookup-of-4096-blocks", encode_lookup(1, b"n" * 8, [b"h" * 8] * 4096)),
    ]  # fmt: skip
    return Target(
        "partition",
        "overlay.partition: push, ack, lookup and lookup-answer decoders",
        (PartitionMessageError,),
        run,
        seeds,
        structured=_cbor_structured,
        crafted=crafted,
        cbor=True,
        nest_open=b"\x81",
        max_random_len=4096,
        mem_bound=lambda n: 8 * n + (8 << 20),
    )


# ---------------------------------------------------------------------------- wire


def _wire_frames() -> list[Any]:
    from prefixmesh.overlay.core import wire as w

    hop = w.Hop(
        peer=b"\x00\x24" + b"p" * 36,
        action="forward",
        reason="prefixmesh: forward",
        next_peer=b"q" * 38,
        local_matched_tokens=32,
        est_local_s=1.5,
        est_peer_s=0.25,
        decide_ms=0.1,
        ttft_ms=210.0,
    )
    return [
        w.Request(
            id=b"r" * 16,
            ns=b"n" * 8,
            credential=b"c" * 32,
            messages=(w.Message("system", "You are terse."), w.Message("user", "Hi!")),
            sampling=w.Sampling(64, 0.0, 1.0, 7),
            deadline=NOW + 60,
            hop_budget=2,
            visited=(b"v" * 38,),
            trace=(hop,),
            stream=True,
        ),
        w.Request(id=b"r2", ns=b"n" * 8, tokens=tuple(range(100)), deadline=NOW,
                  holders=((b"h" * 38, 4), (b"k" * 38, 2))),
        w.Tokens(text="Hello", token_ids=(9906, 11)),
        w.Final(
            id=b"r" * 16,
            entry=b"e" * 38,
            serving=b"s" * 38,
            prompt_tokens=120,
            cached_tokens=96,
            completion_tokens=20,
            ttft_ms=180.5,
            total_ms=900.0,
            finish_reason="stop",
            hops=(hop, hop),
        ),
        w.End(),
        w.Error(code="overloaded", message="queue full"),
        w.Ping(nonce=12345),
        w.Pong(nonce=12345, queue_depth=3, active=1),
        w.PeersQuery(),
        w.PeersReply(
            self_peer=b"s" * 38,
            model=MODEL_FP,
            addrs=("/ip4/127.0.0.1/tcp/1",),
            peers=(
                w.PeerInfo(b"p" * 38, ("/ip4/10.0.0.2/tcp/4001",), True, True, 1.5, 0, 1, 240, 3.0),
            ),
            stats={"records_applied": 10, "rejected_BadSignature": 1},
        ),
        # a raw-prompt completion for another model: text instead of messages and tokens
        w.Request(id=b"r3", ns=b"n" * 8, prompt="Once upon a time", model=MODEL_FP,
                  deadline=NOW),
        # a serving node's first TOKENS frame: the prompt and cached counts come with it
        w.Tokens(text="Once", token_ids=(7454,), prompt_tokens=120, cached_tokens=96),
    ]


@_builder("cbor")
def _cbor_target() -> Target:
    # the shared bounded scanner every codec runs first (overlay/core/cbor.py), fuzzed on
    # its own so a scanner bug shows here and not only through one codec's schema
    from prefixmesh.overlay.core import cbor

    def run(data: bytes) -> object:
        return cbor.loads(data, max_depth=8, max_items=4096)

    values: list[Any] = [
        0, -1, 2**64 - 1, 1.5, math.inf, None, True, False, "", "t\u00e9xt", b"", b"\x00" * 40,
        [], {}, [1, [2, [3, [4, [5, [6, [7]]]]]]], {"a": [1.5, None, True], "b": {b"k": b"v"}},
        [[b"p" * 38, 3, [2, 1, 420.0, 120.0], 1.7e9]] * 4,
    ]
    seeds = [cbor2.dumps(v, canonical=True) for v in values]
    n = 512 * 1024
    crafted = [
        ("max-array-of-zeros", b"\x9a" + (n - 5).to_bytes(4, "big") + b"\x00" * (n - 5)),
        ("lying-8-byte-length", b"\x5b" + (2**60).to_bytes(8, "big") + b"\x00" * 64),
        ("deep-nesting", b"\x81" * 4096 + b"\x00"),
    ]
    return Target(
        "cbor",
        "overlay.core.cbor.loads",
        (cbor.CborError,),
        run,
        seeds,
        structured=_cbor_structured,
        crafted=crafted,
        cbor=True,
        nest_open=b"\x81",
        max_random_len=2048,
        mem_bound=lambda n: 16 * n + (4 << 20),
    )


@_builder("wire")
def _wire_target() -> Target:
    from prefixmesh.overlay.core.wire import MAX_FRAME_BYTES, WireError, decode_body, encode_frame

    seeds = [encode_frame(f)[4:] for f in _wire_frames()]
    n = MAX_FRAME_BYTES
    crafted = [
        ("max-array-of-zeros", b"\x9a" + (n - 5).to_bytes(4, "big") + b"\x00" * (n - 5)),
        (
            "req-max-tokens-list",
            b"\xa1\x63tok\x9a" + (n - 10).to_bytes(4, "big") + b"\x00" * (n - 10),
        ),
        ("max-text", b"\x7a" + (n - 5).to_bytes(4, "big") + b"a" * (n - 5)),
    ]
    return Target(
        "wire",
        "overlay.wire.decode_body",
        (WireError,),
        decode_body,
        seeds,
        structured=_cbor_structured,
        crafted=crafted,
        cbor=True,
        nest_open=b"\x81",
        max_random_len=2048,
        mem_bound=lambda n: 16 * n + (4 << 20),
    )


@_builder("wire-stream")
def _wire_stream_target() -> Target:
    from prefixmesh.overlay.core import wire as w

    frames = [w.encode_frame(f) for f in _wire_frames()]
    req, tok, fin, end, err = frames[0], frames[2], frames[3], frames[4], frames[5]
    seeds = [tok + tok + fin + end, tok + err, fin + end, tok * 5 + fin + end, b""]

    def run(data: bytes) -> object:
        crng = random.Random(zlib.crc32(data))  # deterministic chunking per input
        dec = w.FrameDecoder()
        state = w.InferStreamState()
        state.request_sent(w.decode_body(req[4:]))
        pos, n_frames = 0, 0
        while pos < len(data):
            step = crng.choice([1, 3, 4, 5, 64, 4096, len(data)])
            dec.feed(data[pos : pos + step])
            pos += step
            for frame in dec.frames():
                state.on_response(frame)
                n_frames += 1
        dec.eof()
        return n_frames

    def structured(rng: random.Random, data: bytes) -> bytes | None:
        # re-frame a structurally mutated body, sometimes with a lying length prefix
        if len(data) < 5:
            return None
        (length,) = struct.unpack(">I", data[:4])
        body = _cbor_structured(rng, data[4 : 4 + length])
        if body is None:
            return None
        prefix = len(body) if rng.random() < 0.8 else rng.choice(_BOUNDARY_U32 + [len(body) + 1])
        return struct.pack(">I", prefix) + body + data[4 + length :]

    n = w.MAX_FRAME_BYTES
    crafted = [
        (
            "max-frame-zeros",
            struct.pack(">I", n) + b"\x9a" + (n - 5).to_bytes(4, "big") + b"\x00" * (n - 5),
        )
    ]
    return Target(
        "wire-stream",
        "overlay.wire.FrameDecoder + InferStreamState (response side)",
        (w.WireError,),
        run,
        seeds,
        structured=structured,
        crafted=crafted,
        cbor=True,
        max_random_len=2048,
        mem_bound=lambda n: 16 * n + (4 << 20),
    )


# ---------------------------------------------------------------------------- identity


def _json_structured(rng: random.Random, data: bytes) -> bytes | None:
    try:
        obj = json.loads(data)
    except Exception:
        return None
    for _ in range(rng.choice([1, 1, 2])):
        obj = mutate_tree(rng, obj, json_only=True)
    try:
        text = json.dumps(obj, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
    except (ValueError, TypeError):
        return None
    return text.encode("utf-8", "surrogatepass")


@_builder("identity")
def _identity_target() -> Target:
    from prefixmesh.overlay.core.identity import MAX_KEY_FILE_BYTES, Identity, IdentityError
    from prefixmesh.overlay.keyfile import load_identity, save_identity

    seeds = []
    for i in range(3):
        path = _scratch() / f"seed-{i}.key"
        path.unlink(missing_ok=True)
        save_identity(Identity.from_seed(bytes([i + 1]) * 32), path)
        seeds.append(path.read_bytes())
    seeds.append(seeds[0].replace(b', "peer_id": ', b', "x": ').rstrip(b"\n"))
    key_path = _scratch() / "fuzz.key"

    def run(data: bytes) -> object:
        _write_private(key_path, data)
        return load_identity(key_path)

    crafted = [
        ("max-size-string", b'"' + b"a" * (MAX_KEY_FILE_BYTES - 2) + b'"'),
        ("max-size-nesting", b"[" * MAX_KEY_FILE_BYTES),
    ]
    return Target(
        "identity",
        "overlay.keyfile.load_identity",
        (IdentityError,),
        run,
        seeds,
        structured=_json_structured,
        crafted=crafted,
        nest_open=b"[",
        nest_close=b"]",
        max_random_len=1024,
    )


@_builder("peer-id")
def _peer_id_target() -> Target:
    from prefixmesh.overlay.core.identity import (
        Identity,
        IdentityError,
        peer_id_from_b58,
        public_key_from_peer_id,
    )

    ids = [Identity.from_seed(bytes([i]) * 32) for i in range(1, 4)]
    seeds = [i.peer_id_b58.encode() for i in ids] + [i.peer_id for i in ids]

    def run(data: bytes) -> object:
        try:
            return public_key_from_peer_id(data)  # the binary form
        except IdentityError:
            pass
        return peer_id_from_b58(data.decode("utf-8", "replace"))  # the text form

    return Target(
        "peer-id",
        "overlay.core.identity.peer_id_from_b58 + public_key_from_peer_id",
        (IdentityError,),
        run,
        seeds,
        max_random_len=128,
    )


# ---------------------------------------------------------------------------- kvstore


@_builder("kvstore")
def _kvstore_target() -> Target:
    from prefixmesh.inference.kvstore import (
        CorruptStateFile,
        _checksum,
        decode_state_file,
        encode_state_file,
    )

    max_payload = 1 << 20
    seeds = []
    for tokens, payload in (
        ([1, 2, 3], b"state" * 20),
        (list(range(300)), bytes(2000)),
        ([49152], b""),
    ):
        head, checksum = encode_state_file(b"\x22" * 32, b"\x01" * 8, tokens, payload)
        seeds.append(head + payload + checksum)
    path = _scratch() / "fuzz.kv"

    def run(data: bytes) -> object:
        _write_private(path, data)
        decode_state_file(path, max_payload=max_payload, verify=False)
        return decode_state_file(path, max_payload=max_payload, verify=True)

    header = struct.Struct("<4sHH32s8sIQ")

    def structured(rng: random.Random, data: bytes) -> bytes | None:
        if len(data) < header.size + 32:
            return None
        fields = list(header.unpack_from(data))
        i = rng.randrange(len(fields))
        if i == 5:
            fields[5] = rng.choice(
                [
                    0,
                    1,
                    2,
                    (1 << 20),
                    (1 << 20) + 1,
                    2**32 - 1,
                    max(0, fields[5] + rng.choice([-1, 1])),
                ]
            )
        elif i == 6:
            fields[6] = rng.choice(
                [
                    0,
                    1,
                    max_payload,
                    max_payload + 1,
                    2**63,
                    2**64 - 1,
                    max(0, fields[6] + rng.choice([-1, 1])),
                ]
            )
        elif i in (1, 2):
            fields[i] = rng.choice([0, 1, 2, 0xFFFF])
        else:
            fields[i] = rng.randbytes(len(fields[i]))
        body = header.pack(*fields) + data[header.size : -32]
        if rng.random() < 0.5:
            body += rng.randbytes(rng.choice([0, 4, 8]))
        return body + (_checksum(body) if rng.random() < 0.7 else data[-32:])

    return Target(
        "kvstore",
        "inference.kvstore.decode_state_file (verify=False and True)",
        (CorruptStateFile,),
        run,
        seeds,
        structured=structured,
        max_random_len=1024,
        mem_bound=lambda n: 4 * n + (4 << 20),
        crafted=[("max-tokens", _kv_max_tokens())],
    )


def _kv_max_tokens() -> bytes:
    from prefixmesh.inference.kvstore import MAX_STATE_TOKENS, encode_state_file

    head, checksum = encode_state_file(b"\x22" * 32, b"\x01" * 8, [7] * MAX_STATE_TOKENS, b"")
    return head + checksum


# ---------------------------------------------------------------------------- config


def _toml_key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        try:
            return str(v)
        except ValueError:  # more digits than int -> str allows: write them by hand
            return ("-" if v < 0 else "") + "9" * 4400
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return (
            "{" + ", ".join(f"{_toml_key(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"
        )
    return '""'  # None has no TOML form


def toml_dump(doc: dict) -> str:
    """A small TOML writer: top-level tables of inline values (enough for configs)."""
    lines = []
    for name, table in doc.items():
        if isinstance(table, dict) and all(isinstance(v, dict) for v in table.values()) and table:
            for sub, inner in table.items():
                lines.append(f"[{_toml_key(str(name))}.{_toml_key(str(sub))}]")
                lines += [f"{_toml_key(str(k))} = {_toml_value(v)}" for k, v in inner.items()]
        elif isinstance(table, dict):
            lines.append(f"[{_toml_key(str(name))}]")
            lines += [f"{_toml_key(str(k))} = {_toml_value(v)}" for k, v in table.items()]
        else:
            lines.insert(0, f"{_toml_key(str(name))} = {_toml_value(table)}")
    return "\n".join(lines) + "\n"


_FULL_CONFIG = """
[node]
listen = "/ip4/0.0.0.0/tcp/4001"
advertise = ["/ip4/192.0.2.7/tcp/4001", "/dns4/node.example.org/tcp/4001"]
bootstrap = ["/ip4/192.0.2.1/tcp/4001/p2p/12D3KooWJ1TsijH7H5F74hfAD5XishQz3sxrmAtVY37GtNd9CqYf"]
mdns = false
key_file = "keys/node.key"
cache_dir = "kv"
ram_budget = "512MiB"
disk_budget = 1073741824
log_level = "debug"
[model]
n_ctx = 2048
n_threads = 2
n_gpu_layers = -1
[digest]
interval_s = 0.5
fanout = 4
byte_budget = "64KiB"
ttl_s = 90
refresh_interval_s = 30.0
[routing]
policy = "prefixmesh"
deadline_s = 30
hop_budget = 3
trust_floor = 0.3
max_fallbacks = 2
[http]
listen = "127.0.0.1:8080"
api_key = ""
[client]
peer = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWJ1TsijH7H5F74hfAD5XishQz3sxrmAtVY37GtNd9CqYf"
tenant = "acme"
max_tokens = 256
[tenants.acme]
secret = "0123456789abcdef0123456789abcdef"
visibility = "private"
allowed_peers = ["12D3KooWJ1TsijH7H5F74hfAD5XishQz3sxrmAtVY37GtNd9CqYf"]
[tenants.shared]
visibility = "public"
"""


@_builder("config")
def _config_target() -> Target:
    from prefixmesh.node.config import ConfigError, load_config

    seeds = [_FULL_CONFIG.encode()]
    examples = Path(__file__).resolve().parent.parent / "examples"
    for p in sorted(examples.glob("*.toml")):
        seeds.append(p.read_bytes())
    folder = _scratch() / "config"
    (folder / "secrets").mkdir(parents=True, exist_ok=True)
    # the secret file examples/tenants.toml names, relative to the config file
    _write_private(folder / "secrets" / "acme.secret", b"fuzz-secret-0123456789abcdef\n")
    path = folder / "node.toml"

    def run(data: bytes) -> object:
        path.write_bytes(data)
        return load_config(path)

    def structured(rng: random.Random, data: bytes) -> bytes | None:
        import tomllib

        try:
            doc = tomllib.loads(data.decode("utf-8"))
        except Exception:
            return None
        if rng.random() < 0.05:  # deep nesting of one value
            depth = rng.choice([100, 1000, 3000])
            return (toml_dump(doc) + "x = " + "[" * depth + "]" * depth + "\n").encode()
        for _ in range(rng.choice([1, 1, 2])):
            doc = mutate_tree(rng, doc, json_only=True)
        if not isinstance(doc, dict):
            return None
        return toml_dump(doc).encode("utf-8", "surrogatepass")

    return Target(
        "config",
        "node.config.load_config (TOML file, tenants included)",
        (ConfigError,),
        run,
        seeds,
        structured=structured,
        max_random_len=1024,
        crafted=[("deep-array", b"a = " + b"[" * 3000 + b"]" * 3000)],
        mem_bound=lambda n: 256 * n + (4 << 20),
        nest_open=b"[",
        nest_close=b"]",
    )


# ---------------------------------------------------------------------------- discovery


@_builder("discovery")
def _discovery_target() -> Target:
    # overlay.discovery imports trio and the libp2p host module (only this target does)
    from prefixmesh.overlay.discovery import (
        MAX_DHT_RECORD_BYTES,
        DhtRecordError,
        PrefixmeshValidator,
        encode_dht_record,
    )

    ident = _fuzz_identity()
    key = f"/prefixmesh/{ident.peer_id_b58}"
    seeds = [
        encode_dht_record(ident, ["/ip4/10.0.0.1/tcp/4001"], NOW),
        encode_dht_record(ident, [], NOW - 5),
        encode_dht_record(
            ident, ["/ip4/10.0.0.1/tcp/4001", "/ip6/::1/tcp/1", "/dns4/example.org/tcp/1"], NOW + 1
        ),
    ]
    validator = PrefixmeshValidator()

    class SelectRaised(Exception):
        """PrefixmeshValidator.select must skip invalid records, never raise."""

    def run(data: bytes) -> object:
        try:
            validator.select(key, [seeds[0], data])
        except Exception as exc:
            raise SelectRaised(f"select raised {type(exc).__name__}: {exc}") from exc
        return validator.validate(key, data)

    def structured(rng: random.Random, data: bytes) -> bytes | None:
        outer = _cbor_load(data)
        if (
            isinstance(outer, list)
            and len(outer) == 2
            and isinstance(outer[0], bytes)
            and rng.random() < 0.75
        ):
            body = _cbor_load(outer[0])
            if body is None:
                return None
            body = cbor_encode(mutate_tree(rng, body), rng)
            from prefixmesh.overlay.discovery import _DHT_RECORD_LABEL

            return cbor2.dumps([body, ident.sign(_DHT_RECORD_LABEL + body)], canonical=True)
        return _cbor_structured(rng, data)

    n = MAX_DHT_RECORD_BYTES
    crafted = [
        ("max-nesting", b"\x81" * n),
        ("max-array", b"\x82\x59" + (n - 4).to_bytes(2, "big") + b"\x9f" * (n - 4)),
    ]
    return Target(
        "discovery",
        "overlay.discovery.PrefixmeshValidator.validate/select (DHT records)",
        (DhtRecordError,),
        run,
        seeds,
        structured=structured,
        crafted=crafted,
        cbor=True,
        nest_open=b"\x81",
        max_random_len=1024,
    )


# ---------------------------------------------------------------------------- dialback


@_builder("dialback")
def _dialback_target() -> Target:
    from prefixmesh.overlay.core.reachability import (
        MAX_MESSAGE_BYTES,
        DialbackAnswer,
        DialbackError,
        DialbackRequest,
        DialResult,
        decode_answer,
        decode_request,
        encode_answer,
        encode_request,
    )

    claimed = ("/ip4/198.18.0.101/tcp/4101", "/ip4/10.77.1.2/tcp/4101", "/ip6/2001:db8::1/tcp/1")
    seeds = [
        encode_request(DialbackRequest(claimed)),
        encode_request(DialbackRequest(())),
        encode_answer(DialbackAnswer("198.18.0.101", 4101, tuple(
            DialResult(a, i == 0, "dialed" if i == 0 else "not the IP you are seen at")
            for i, a in enumerate(claimed)))),
        encode_answer(DialbackAnswer("", 0, ())),
    ]

    def run(data: bytes) -> object:
        try:
            return decode_request(data)
        except DialbackError:
            return decode_answer(data)

    n = MAX_MESSAGE_BYTES
    crafted = [
        ("max-nesting", b"\x81" * n),
        ("long-string", b"\x82\x01\x81\x79" + (n - 6).to_bytes(2, "big") + b"/" * (n - 6)),
    ]
    return Target(
        "dialback",
        "overlay.core.reachability: dial-back request and answer decoders",
        (DialbackError,),
        run,
        seeds,
        structured=_cbor_structured,
        crafted=crafted,
        cbor=True,
        nest_open=b"\x81",
        max_random_len=1024,
    )


TARGET_NAMES = tuple(_BUILDERS)


# ---------------------------------------------------------------------------- running


@dataclass
class Outcome:
    kind: str  # "ok" | "error" (typed) | "bug"
    exc_type: str  # "" for ok
    message: str
    seconds: float
    peak_bytes: int | None = None

    @property
    def label(self) -> str:
        return self.exc_type or "ok"


def run_one(
    target: Target, data: bytes, *, hang_s: float = 10.0, measure_memory: bool = False
) -> Outcome:
    """Run one input; classify the result (never raises for decoder behaviour)."""
    if measure_memory:
        tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with time_limit(hang_s):
            target.run(data)
        kind, exc_type, message = "ok", "", ""
    except target.errors as exc:
        kind, exc_type, message = "error", type(exc).__name__, str(exc)
    except FuzzHang as exc:
        kind, exc_type, message = "bug", "Hang", str(exc)
    except Exception as exc:
        kind, exc_type, message = "bug", type(exc).__name__, str(exc)[:200]
    seconds = time.perf_counter() - t0
    peak = None
    if measure_memory:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return Outcome(kind, exc_type, message, seconds, peak)


def _template(message: str) -> str:
    return re.sub(r"0x[0-9a-f]+|[0-9a-f]{8,}|\d+(\.\d+)?", "N", message)[:60]


def corpus_files(name: str, corpus: Path = DEFAULT_CORPUS) -> list[Path]:
    folder = corpus / name
    return sorted(p for p in folder.glob("*.bin")) if folder.is_dir() else []


def save_case(name: str, label: str, data: bytes, corpus: Path = DEFAULT_CORPUS) -> Path:
    folder = corpus / name
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{label}-{hashlib.sha1(data).hexdigest()[:10]}.bin"
    path.write_bytes(data)
    return path


def run_fuzz(
    name: str,
    count: int,
    *,
    seed: int = 0,
    corpus: Path | None = DEFAULT_CORPUS,
    save: bool = True,
    slow_s: float = 0.25,
    hang_s: float = 10.0,
    mem_every: int = 100,
    max_saves: int = 40,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Fuzz decoder ``name`` with ``count`` inputs; returns the report as a dict."""
    target = get_target(name)
    rng = random.Random(seed)
    pool = list(target.seeds)
    seen_types: set[str] = set()
    existing = corpus_files(name, corpus) if corpus else []
    for p in existing:  # what the corpus already shows is not new
        data = p.read_bytes()
        seen_types.add(run_one(target, data, hang_s=hang_s).label)
        if len(data) <= MAX_CASE_BYTES and not p.name.startswith("slow-"):
            pool.append(data)
    outcomes: Counter[str] = Counter()
    templates: set[str] = set()
    bugs: Counter[str] = Counter()
    saved: list[str] = []
    max_s, max_s_len, max_s_label = 0.0, 0, ""
    peak_sampled, peak_len = 0, 0
    sizes = 0
    t_start = time.perf_counter()
    for i in range(count):
        data = generate(rng, target, pool)
        sizes += len(data)
        out = run_one(
            target, data, hang_s=hang_s, measure_memory=mem_every > 0 and i % mem_every == 0
        )
        outcomes[out.label] += 1
        if out.kind == "error":
            templates.add(out.label + ":" + _template(out.message))
        if out.kind == "bug":
            bugs[out.label] += 1
        if out.peak_bytes is not None and out.peak_bytes > peak_sampled:
            peak_sampled, peak_len = out.peak_bytes, len(data)
        if out.seconds > max_s:
            max_s, max_s_len, max_s_label = out.seconds, len(data), out.label
        new_type = out.label not in seen_types
        slow = out.seconds > slow_s
        if new_type or slow:
            seen_types.add(out.label)
            if not slow and len(data) <= MAX_CASE_BYTES:  # slow seeds would snowball
                pool.append(data)
            # the corpus keeps small cases only (oversize inputs are the crafted ones)
            if (
                save
                and corpus is not None
                and len(saved) < max_saves
                and len(data) <= MAX_CASE_BYTES
            ):
                prefix = "crash-" if out.kind == "bug" else "slow-" if slow else "new-"
                saved.append(str(save_case(name, prefix + out.label, data, corpus)))
        if progress and (i + 1) % 10_000 == 0:
            progress(f"{name}: {i + 1}/{count} inputs, {dict(outcomes.most_common(6))}")
    elapsed = time.perf_counter() - t_start
    crafted = {}
    for label, data in target.crafted:
        o = run_one(target, data, hang_s=hang_s, measure_memory=True)
        crafted[label] = {
            "bytes": len(data),
            "outcome": o.label,
            "seconds": round(o.seconds, 4),
            "peak_bytes": o.peak_bytes,
            "bound_bytes": target.mem_bound(len(data)),
        }
    return {
        "decoder": name,
        "what": target.what,
        "count": count,
        "seed": seed,
        "seconds": round(elapsed, 2),
        "inputs_per_s": round(count / elapsed, 1) if elapsed else None,
        "mean_input_bytes": round(sizes / count, 1) if count else 0,
        "outcomes": dict(outcomes.most_common()),
        "error_classes": sorted(k for k in outcomes if k != "ok" and k not in bugs),
        "distinct_error_messages": len(templates),
        "bugs": dict(bugs),
        "max_seconds_per_input": round(max_s, 4),
        "max_seconds_input_bytes": max_s_len,
        "max_seconds_outcome": max_s_label,
        "peak_bytes_sampled": peak_sampled,
        "peak_sampled_input_bytes": peak_len,
        "crafted": crafted,
        "saved": saved,
    }


def _print_report(r: dict) -> None:
    print(f"== {r['decoder']}: {r['what']}")
    print(
        f"   {r['count']} inputs in {r['seconds']} s ({r['inputs_per_s']}/s), "
        f"mean {r['mean_input_bytes']} B; max {r['max_seconds_per_input'] * 1000:.1f} ms "
        f"({r['max_seconds_input_bytes']} B, {r['max_seconds_outcome']})"
    )
    print(f"   outcomes: {r['outcomes']}")
    print(
        f"   distinct error messages: {r['distinct_error_messages']}; bugs: {r['bugs'] or 'none'}"
    )
    print(
        f"   sampled peak memory {r['peak_bytes_sampled'] / 1024:.0f} KiB "
        f"(input {r['peak_sampled_input_bytes']} B)"
    )
    for label, c in r["crafted"].items():
        print(
            f"   crafted {label}: {c['bytes']} B -> {c['outcome']} in {c['seconds']} s, "
            f"peak {c['peak_bytes'] / 1024:.0f} KiB (bound {c['bound_bytes'] / 1024:.0f} KiB)"
        )
    for s in r["saved"]:
        print(f"   saved {s}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--decoder", default="all", help="a decoder name, or 'all'")
    p.add_argument("--count", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    p.add_argument("--no-save", action="store_true", help="do not write corpus files")
    p.add_argument("--slow-s", type=float, default=0.25)
    p.add_argument("--hang-s", type=float, default=10.0)
    p.add_argument("--mem-every", type=int, default=100)
    p.add_argument("--json", type=Path, help="append the reports to this JSON file")
    p.add_argument("--list", action="store_true")
    ns = p.parse_args(argv)
    ok, missing = available_targets()
    if ns.list:
        for name, t in ok.items():
            print(f"{name:12s} {t.what}")
        for name, why in missing.items():
            print(f"{name:12s} MISSING: {why}")
        return 0
    names = list(ok) if ns.decoder == "all" else [ns.decoder]
    reports = []
    for name in names:
        if name not in ok:
            print(f"{name}: not available: {missing.get(name, 'unknown decoder')}")
            continue
        r = run_fuzz(
            name,
            ns.count,
            seed=ns.seed,
            corpus=ns.corpus,
            save=not ns.no_save,
            slow_s=ns.slow_s,
            hang_s=ns.hang_s,
            mem_every=ns.mem_every,
            progress=lambda m: print("  " + m, file=sys.stderr, flush=True),
        )
        _print_report(r)
        reports.append(r)
        if ns.json:  # after each decoder, so a long run keeps what it has measured
            old = json.loads(ns.json.read_text()) if ns.json.exists() else []
            ns.json.write_text(json.dumps(old + [r], indent=1, default=str))
    return 1 if any(r["bugs"] for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
