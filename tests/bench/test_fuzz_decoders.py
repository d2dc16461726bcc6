"""Fuzzing every decoder that reads peer- or disk-supplied bytes (targets: bench/fuzz.py).

For each decoder: its valid seed encodings decode; ~300 hypothesis examples of plain
random bytes and of byte- and structure-mutated encodings raise only the module's typed
error (or decode), each under a wall-clock budget (SIGALRM, a hang guard, not a speed
assertion); crafted worst-case inputs (the largest its limits allow) stay under a
documented tracemalloc bound; and every regression case in tests/fuzz_corpus/<decoder>/
is replayed. Cases named ``bug-*`` or ``crash-*`` reproduce bugs found by the fuzzer
(see docs/SECURITY.md); they fail until the decoder's owner fixes them.

The long run (>= 100,000 inputs per decoder) is ``python -m prefixmesh.bench.fuzz``.
"""

from __future__ import annotations

import random
import shutil
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixmesh.bench.fuzz import (
    DEFAULT_CORPUS,
    MISSING_TARGETS,
    TARGET_NAMES,
    corpus_files,
    generate,
    get_target,
    run_one,
    time_limit,
)

HANG_S = 20.0  # per input; generous: a guard against hangs, not a speed test
NAMES = sorted(TARGET_NAMES)

#: Bugs already reproduced by ``bug-*`` corpus cases (which fail until fixed): the
#: generated-input test tolerates these exception types so that it keeps looking for
#: *other* bugs. Remove an entry when its owner has fixed it.
KNOWN_BUGS: dict[str, tuple[type[BaseException], ...]] = {
    # Empty: every bug the fuzzer found is fixed, and its input is kept in the corpus.
    # (Add a decoder's tolerated exception types here only while a found bug is open.)
}


def _decode(name: str, data: bytes, tolerate: tuple[type[BaseException], ...] = ()) -> None:
    """Run ``data`` through decoder ``name``; only its typed errors may escape silently."""
    target = get_target(name)
    try:
        with time_limit(HANG_S):
            target.run(data)
    except target.errors:
        pass
    except tolerate:
        pass


def test_every_target_builds():
    """Each listed decoder imports and produces its seeds (a broken module fails here)."""
    for name in NAMES:
        assert get_target(name).seeds, name
    assert not MISSING_TARGETS  # every decoder named in issue 7 exists


@pytest.mark.parametrize("name", NAMES)
def test_seeds_are_valid_encodings(name):
    """Mutation starts from inputs the decoder accepts (else it would fuzz only the front door)."""
    target = get_target(name)
    for seed in target.seeds:
        out = run_one(target, seed, hang_s=HANG_S)
        assert out.kind == "ok", (name, out.label, out.message, seed[:80])


@pytest.mark.parametrize("name", NAMES)
@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_generated_and_mutated_inputs_raise_only_typed_errors(name, data):
    target = get_target(name)
    raw = st.binary(max_size=target.max_random_len)
    mutated = st.integers(0, 2**64 - 1).map(lambda s: generate(random.Random(s), target))
    from_corpus = st.sampled_from(target.seeds).flatmap(
        lambda seed: st.integers(0, 2**32).map(lambda s: generate(random.Random(s), target, [seed]))
    )
    _decode(
        name,
        data.draw(st.one_of(raw, mutated, from_corpus), label="input"),
        KNOWN_BUGS.get(name, ()),
    )


def _corpus_cases() -> list:
    cases = []
    for name in NAMES:
        for path in corpus_files(name):
            cases.append(pytest.param(name, path, id=f"{name}/{path.name}"))
    return cases


@pytest.mark.parametrize("name,path", _corpus_cases())
def test_corpus_replay(name, path: Path):
    _decode(name, path.read_bytes())


def test_corpus_is_small_and_known():
    """The corpus holds only folders of existing decoders and small files."""
    assert DEFAULT_CORPUS.is_dir()
    for folder in DEFAULT_CORPUS.iterdir():
        assert folder.name in TARGET_NAMES, folder
        for f in folder.iterdir():
            assert f.suffix == ".bin" and f.stat().st_size <= 64 * 1024, f


@pytest.mark.parametrize("name", [n for n in NAMES if get_target(n).crafted])
def test_crafted_worst_cases_have_bounded_memory(name):
    """The largest inputs a decoder's limits allow: typed errors only, peak memory bounded."""
    target = get_target(name)
    for label, data in target.crafted:
        tracemalloc.start()
        try:
            _decode(name, data, KNOWN_BUGS.get(name, ()))  # those fail in test_corpus_replay
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        bound = target.mem_bound(len(data))
        assert peak <= bound, f"{name}/{label}: peak {peak} B > bound {bound} B for {len(data)} B"


def test_kvstore_rebuild_survives_fuzzed_files(tmp_path):
    """KVStore's start-up scan discards every malformed file found on disk, never raises."""
    from prefixmesh.inference.kvstore import KVStore

    fp = b"\x22" * 32
    ns_dir = tmp_path / fp.hex()[:32] / ("01" * 8)
    ns_dir.mkdir(parents=True)
    target = get_target("kvstore")
    rng = random.Random(4)
    inputs = [p.read_bytes() for p in corpus_files("kvstore")]
    inputs += [generate(rng, target) for _ in range(40)] + list(target.seeds)
    for i, data in enumerate(inputs):
        (ns_dir / f"{i:04d}.kv").write_bytes(data)
    shutil.copy(ns_dir / "0000.kv", ns_dir / ".tmp-interrupted")
    with time_limit(HANG_S):
        store = KVStore(
            fingerprint=fp, ram_budget_bytes=1 << 20, disk_budget_bytes=1 << 24, disk_dir=tmp_path
        )
    # no file carries its content-derived name, so every one is discarded as misplaced
    # or malformed; none is loaded
    assert store.prefixes() == []
    assert list(ns_dir.iterdir()) == []
