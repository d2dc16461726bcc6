"""KV store logic with synthetic state bytes (no llama): tiers, budgets, pins, events,
namespaces, the disk format and its recovery from damaged files."""

from __future__ import annotations

import random
import struct
import tempfile
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.inference.kvstore import (
    CHECKSUM_BYTES,
    KVStore,
    KVStoreError,
    StoreChange,
    encode_state_file,
)

FP = bytes(range(32))
OTHER_FP = bytes(32)
NS_A = b"A" * 8
NS_B = b"B" * 8


def state_for(tokens, size=1000) -> bytes:
    """Deterministic fake state bytes that name their tokens (so a wrong restore shows)."""
    seed = struct.pack(f"<{len(tokens)}I", *tokens)
    return (seed * (size // max(1, len(seed)) + 1))[:size]


_open_stores: dict[Path, list[KVStore]] = {}


@pytest.fixture(autouse=True)
def _close_stores():
    yield
    for stores in _open_stores.values():
        for store in stores:
            store.close(flush=False)
    _open_stores.clear()


def make_store(tmp_path, *, ram=10_000, disk=50_000, events=None, fp=FP, **kw) -> KVStore:
    # a new store on the same folder is a restart: the previous one stops first (its writer
    # must not race the new store's start-up scan)
    for old in _open_stores.pop(tmp_path, []):
        old.close()
    store = _new_store(tmp_path, ram, disk, events, fp, **kw)
    _open_stores.setdefault(tmp_path, []).append(store)
    return store


def _new_store(tmp_path, ram, disk, events, fp, **kw) -> KVStore:
    return KVStore(
        fingerprint=fp,
        ram_budget_bytes=ram,
        disk_budget_bytes=disk,
        disk_dir=tmp_path / "kv",
        on_change=(events.append if events is not None else None),
        fsync=False,
        **kw,
    )


def files(store: KVStore) -> list[Path]:
    return sorted(store.model_dir.glob("*/*.kv"))


def test_put_and_acquire_longest_prefix(tmp_path):
    s = make_store(tmp_path)
    assert s.put(NS_A, [1, 2, 3, 4], state_for([1, 2, 3, 4]))
    assert s.put(NS_A, [1, 2], state_for([1, 2]))
    with s.acquire(NS_A, [1, 2, 3, 4, 5]) as lease:
        assert (lease.tier, lease.length, lease.entry_tokens) == ("ram", 4, 4)
        assert lease.data == state_for([1, 2, 3, 4])
    # a shorter match is served by the shortest entry that covers it
    with s.acquire(NS_A, [1, 2, 9]) as lease:
        assert (lease.length, lease.tokens) == (2, (1, 2))
    with s.acquire(NS_A, [1, 2, 3, 9]) as lease:  # truncation of a longer entry
        assert (lease.length, lease.tokens) == (3, (1, 2, 3, 4))
    assert s.acquire(NS_A, [7, 8]) is None
    assert s.stats.hits_ram == 3 and s.stats.misses == 1
    s._check_invariants()


def test_namespaces_never_share(tmp_path):
    s = make_store(tmp_path)
    s.put(NS_A, [1, 2, 3], state_for([1, 2, 3]))
    assert s.acquire(NS_B, [1, 2, 3, 4]) is None
    assert s.lookup_length(NS_B, [1, 2, 3]) == (0, None)
    s.flush_to_disk()
    s.set_budgets(ram_bytes=0)  # only the disk copy is left
    assert s.acquire(NS_B, [1, 2, 3, 4]) is None
    with s.acquire(NS_A, [1, 2, 3, 4]) as lease:
        assert lease.tier == "disk" and lease.length == 3
    # after a restart too
    s2 = make_store(tmp_path)
    assert s2.acquire(NS_B, [1, 2, 3]) is None
    assert s2.acquire(NS_A, [1, 2, 3]).length == 3


def test_demotion_promotion_and_events(tmp_path):
    events: list[StoreChange] = []
    s = make_store(tmp_path, ram=2 * 1100, disk=10_000, events=events)
    for i in range(3):
        s.put(NS_A, [i, i], state_for([i, i]))
    # three adds; the first entry was demoted to disk (still cached: no remove)
    assert [e.kind for e in events] == ["add"] * 3
    assert s.contains(NS_A, [0, 0]) == "disk"
    assert s.stats.demotions == 1
    with s.acquire(NS_A, [0, 0, 5]) as lease:
        assert lease.tier == "disk" and lease.data == state_for([0, 0])
    assert s.contains(NS_A, [0, 0]) == "ram"  # promoted, file kept
    assert s.stats.promotions == 1
    assert [e.kind for e in events] == ["add"] * 3
    s._check_invariants()


def test_remove_event_when_leaving_both_tiers(tmp_path):
    events: list[StoreChange] = []
    s = make_store(tmp_path, ram=1100, disk=0, events=events)  # no disk tier at all
    s.put(NS_A, [1], state_for([1]))
    s.put(NS_A, [2], state_for([2]))
    assert events == [
        StoreChange("add", NS_A, (1,)),
        StoreChange("remove", NS_A, (1,)),  # evicted to make room, before the add
        StoreChange("add", NS_A, (2,)),
    ]
    assert s.remove(NS_A, [2])
    assert events[-1] == StoreChange("remove", NS_A, (2,))
    assert not s.remove(NS_A, [2])


def test_budgets_hold_for_200_prefixes_and_pins_survive(tmp_path):
    events: list[StoreChange] = []
    s = make_store(tmp_path, ram=8 * 1100, disk=20 * 1200, events=events)
    s.put(NS_A, [999, 1], state_for([999, 1]))
    lease = s.acquire(NS_A, [999, 1, 5])
    rng = random.Random(1)
    cached: set[tuple] = set()
    for i in range(200):
        toks = [i, rng.randrange(1000), rng.randrange(1000)]
        ns = NS_A if i % 2 else NS_B
        assert s.put(ns, toks, state_for(toks, 900 + rng.randrange(200)))
        assert s.ram_used_bytes <= 8 * 1100
        assert s.disk_used_bytes <= 20 * 1200
        # the pinned entry is never evicted from RAM while the lease is held
        assert s.contains(NS_A, [999, 1]) == "ram"
    s._check_invariants()
    lease.release()
    for e in events:
        key = (e.ns_id, e.tokens)
        if e.kind == "add":
            cached.add(key)
        else:
            cached.discard(key)
    live = {(nid, toks) for nid, toks, _ in s.prefixes()}
    assert cached == live
    assert 10 < len(live) < 40  # both tiers hold some; most were evicted
    # after release the formerly pinned entry can be evicted like any other: it was used
    # twice (put, acquire), so it goes once newer entries were used twice too (LRU-2)
    for i in range(30):
        s.put(NS_B, [5000 + i], state_for([5000 + i]))
        s.lookup_length(NS_B, [5000 + i])
    assert s.contains(NS_A, [999, 1]) != "ram"
    s._check_invariants()


def test_pinned_entry_cannot_be_removed(tmp_path):
    s = make_store(tmp_path)
    s.put(NS_A, [1, 2], state_for([1, 2]))
    with s.acquire(NS_A, [1, 2]):
        with pytest.raises(KVStoreError, match="in use"):
            s.remove(NS_A, [1, 2])
    assert s.remove(NS_A, [1, 2])


def test_too_big_for_ram_goes_to_disk(tmp_path):
    s = make_store(tmp_path, ram=500, disk=10_000)
    assert s.put(NS_A, [1, 2, 3], state_for([1, 2, 3], 2000))
    assert s.contains(NS_A, [1, 2, 3]) == "disk"
    s2 = make_store(tmp_path, ram=500, disk=1000)  # now too big for both
    assert s2.contains(NS_A, [1, 2, 3]) is None
    assert not s2.put(NS_A, [4], state_for([4], 2000))


def test_restart_rebuilds_index_and_recency(tmp_path):
    s = make_store(tmp_path, ram=100_000, disk=100_000)
    for i in range(5):
        s.put(NS_A, [i, 1, 2], state_for([i, 1, 2]))
    assert s.flush_to_disk() == 5
    assert len(files(s)) == 5
    events: list[StoreChange] = []
    s2 = make_store(tmp_path, ram=100_000, disk=100_000, events=events)
    assert sorted(e.tokens for e in events) == [(i, 1, 2) for i in range(5)]
    assert all(e.kind == "add" for e in events)
    with s2.acquire(NS_A, [3, 1, 2, 9]) as lease:
        assert lease.tier == "disk" and lease.data == state_for([3, 1, 2])
    s2._check_invariants()


def _damage(path: Path, how: str) -> None:
    raw = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(raw[: len(raw) - 7]))
    elif how == "flip-payload":
        raw[len(raw) - CHECKSUM_BYTES - 10] ^= 0x01
        path.write_bytes(bytes(raw))
    elif how == "flip-magic":
        raw[0] ^= 0xFF
        path.write_bytes(bytes(raw))
    elif how == "empty":
        path.write_bytes(b"")
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["truncate", "flip-payload", "flip-magic", "empty"])
@pytest.mark.parametrize("verify_on_start", [False, True])
def test_corrupt_files_are_removed(tmp_path, how, verify_on_start, caplog):
    s = make_store(tmp_path)
    s.put(NS_A, [1, 2, 3], state_for([1, 2, 3]))
    s.put(NS_A, [4, 5, 6], state_for([4, 5, 6]))
    s.flush_to_disk()
    bad = s._disk.get(s._key(NS_A, [1, 2, 3])).payload.path
    _damage(bad, how)
    s2 = make_store(tmp_path, verify_on_start=verify_on_start)
    # start-up reads headers only: a damaged payload (size intact) is found on first load
    lazy = how == "flip-payload" and not verify_on_start
    assert s2.stats.corrupt_files_removed == (0 if lazy else 1)
    assert bad.exists() == lazy
    assert s2.acquire(NS_A, [1, 2, 3]) is None
    assert s2.stats.corrupt_files_removed == 1 and not bad.exists()
    assert s2.acquire(NS_A, [4, 5, 6]).length == 3
    assert "removing KV state file" in caplog.text
    s2._check_invariants()


def test_corruption_after_start_is_caught_on_load(tmp_path):
    s = make_store(tmp_path, verify_on_start=False)
    s.put(NS_A, [1, 2, 3], state_for([1, 2, 3]))
    s.put(NS_A, [1, 2], state_for([1, 2]))
    s.flush_to_disk()
    s2 = make_store(tmp_path, verify_on_start=False)
    bad = s2._disk.get(s2._key(NS_A, [1, 2, 3])).payload.path
    _damage(bad, "flip-payload")
    # the damaged longer entry is dropped; the lookup falls back to the intact shorter one
    with s2.acquire(NS_A, [1, 2, 3, 4]) as lease:
        assert lease.tokens == (1, 2) and lease.data == state_for([1, 2])
    assert s2.stats.corrupt_files_removed == 1 and not bad.exists()
    s2._check_invariants()


def test_foreign_and_misplaced_files_are_removed(tmp_path):
    s = make_store(tmp_path)
    s.put(NS_A, [1, 2, 3], state_for([1, 2, 3]))
    s.flush_to_disk()
    good = files(s)[0]
    # a file of another model (valid checksum) dropped into our folder
    head, chk = encode_state_file(OTHER_FP, NS_A, [7, 7], b"x" * 50)
    foreign = good.parent / ("0" * 32 + ".kv")
    foreign.write_bytes(head + b"x" * 50 + chk)
    # a valid file of ours under the wrong namespace folder
    misplaced_dir = s.model_dir / NS_B.hex()
    misplaced_dir.mkdir()
    misplaced = misplaced_dir / good.name
    misplaced.write_bytes(good.read_bytes())
    # a leftover temp file of an interrupted write
    tmp = good.parent / ".tmp-abc.kv"
    tmp.write_bytes(b"partial")
    s2 = make_store(tmp_path)
    assert s2.stats.foreign_files_removed == 1
    assert s2.stats.corrupt_files_removed == 1
    assert not foreign.exists() and not misplaced.exists() and not tmp.exists()
    assert good.exists() and s2.acquire(NS_A, [1, 2, 3]).length == 3
    # another model's own folder is left alone (its engine may run later)
    s3 = make_store(tmp_path, fp=OTHER_FP)
    assert s3.model_dir != s2.model_dir and good.exists()


def test_oversize_header_fields_are_refused(tmp_path):
    s = make_store(tmp_path, disk=5000)
    ns_dir = s.model_dir / NS_A.hex()
    ns_dir.mkdir(parents=True)
    # header claims an enormous payload: refused from the header alone, never read
    head, chk = encode_state_file(FP, NS_A, [1], b"y" * 10)
    huge = bytearray(head)
    struct.pack_into("<Q", huge, 52, 1 << 40)
    p = ns_dir / ("1" * 32 + ".kv")
    p.write_bytes(bytes(huge) + b"y" * 10 + chk)
    s2 = make_store(tmp_path, disk=5000)
    assert s2.stats.corrupt_files_removed == 1 and not p.exists()


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["put", "segment", "acquire", "remove", "flush", "restart",
                             "crash"]),
            st.sampled_from([NS_A, NS_B]),
            st.lists(st.integers(0, 3), min_size=1, max_size=5),
            st.integers(100, 3000),
        ),
        max_size=40,
    )
)
def test_property_budgets_events_and_isolation(ops):
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        events: list[StoreChange] = []
        s = make_store(root, ram=4000, disk=9000, events=events)
        model: dict[tuple, bytes] = {}  # what any restore may return, per (ns, tokens)
        for op, ns, toks, size in ops:
            if op in ("put", "segment"):
                # a segment holds only the tokens past the longest stored prefix
                base = s.parent_length(ns, toks) if op == "segment" else 0
                data = state_for(toks[base:], size // (2 if base else 1)) + ns
                if s.put(ns, toks, data, base=base):
                    model[(ns, tuple(toks))] = data
            elif op == "acquire":
                lease = s.acquire(ns, toks)
                if lease is not None:
                    with lease:
                        # every segment belongs to this namespace and is the state stored for
                        # its tokens; together they extend the query's prefix
                        segs = lease.segments
                        assert segs[0][0] == 0
                        ends = [b for b, _ in segs[1:]] + [lease.entry_tokens]
                        for (_, data), end in zip(segs, ends, strict=True):
                            assert data == model[(ns, lease.tokens[:end])]
                        assert tuple(lease.tokens[: lease.length]) == tuple(toks[: lease.length])
            elif op == "remove":
                s.remove(ns, toks)
            elif op == "flush":
                s.flush_to_disk()
            else:
                # restart: a clean stop flushes; a crash drops what is still queued (what
                # is on disk stays valid either way)
                s.close(flush=op == "restart")
                events.clear()
                s = make_store(root, ram=4000, disk=9000, events=events)
            assert s.ram_used_bytes <= 4000 and s.disk_used_bytes <= 9000
            s._check_invariants()
            # events describe exactly the cached set (since the last restart)
        cached: set = set()
        for e in events:
            (cached.add if e.kind == "add" else cached.discard)((e.ns_id, e.tokens))
        assert cached == {(nid, t) for nid, t, _ in s.prefixes()}
        s.close()


# ---------------------------------------------------------------- write-behind


class _GatedWriter:
    """Holds the writer thread before each write until ``open()`` (unit tests of the
    queue logic: which states get written, which are skipped, what is served meanwhile)."""

    def __init__(self, monkeypatch):
        self.gate = threading.Event()
        original = KVStore._write_one

        def gated(store, *args):
            self.gate.wait()
            original(store, *args)

        monkeypatch.setattr(KVStore, "_write_one", gated)

    def open(self):
        self.gate.set()


def test_write_behind_writes_every_put_without_a_flush(tmp_path):
    s = make_store(tmp_path, ram=100_000, disk=100_000)
    for i in range(5):
        s.put(NS_A, [i, 7], state_for([i, 7]))
    assert s.wait_written()  # no flush_to_disk: the puts alone reach disk
    assert len(files(s)) == 5 and s.stats.disk_writes == 5
    s._check_invariants()


def test_queued_state_is_served_from_memory_and_skipped_when_evicted(tmp_path, monkeypatch):
    gated = _GatedWriter(monkeypatch)
    s = make_store(tmp_path, ram=1100, disk=2300)
    s.put(NS_A, [1], state_for([1]))
    s.put(NS_A, [2], state_for([2]))  # evicts [1] from RAM: its disk copy is still queued
    assert s.contains(NS_A, [1]) == "disk" and files(s) == []
    with s.acquire(NS_A, [1, 5]) as lease:
        assert lease.data == state_for([1])  # from the queued bytes
    s.remove(NS_A, [2])
    s.put(NS_A, [3], state_for([3]))
    s.put(NS_A, [4], state_for([4]))  # the disk budget drops queued states, LRU first
    gated.open()
    assert s.wait_written()
    s._check_invariants()
    on_disk = {e.tokens[1:] for e in s._disk.entries()}
    assert s.stats.writes_skipped >= 1
    assert len(files(s)) == len(on_disk) and s.stats.disk_writes == len(on_disk)
    for toks in on_disk:
        assert s.acquire(NS_A, list(toks)).data == state_for(list(toks))


@pytest.mark.parametrize("limit", ["age", "bytes"])
def test_back_pressure_keeps_the_window_bounded(tmp_path, monkeypatch, limit):
    gated = _GatedWriter(monkeypatch)
    kw = {"write_delay_s": 0.05} if limit == "age" else {"max_pending_bytes": 1500}
    s = make_store(tmp_path, ram=100_000, disk=100_000, **kw)
    s.put(NS_A, [1], state_for([1]))
    assert s.stats.write_waits == 0
    if limit == "age":
        time.sleep(0.1)  # [1] is now overdue
    threading.Timer(0.2, gated.open).start()
    s.put(NS_A, [2], state_for([2]))  # waits for the writer instead of growing the window
    assert s.stats.write_waits == 1
    assert s._disk.get(s._key(NS_A, [1])).payload.data is None  # [1] was written
    s._check_invariants()


def test_close_is_bounded_and_a_crash_leaves_valid_files(tmp_path, monkeypatch):
    s = make_store(tmp_path, ram=100_000, disk=100_000)
    s.put(NS_A, [1, 2], state_for([1, 2]))
    s.flush_to_disk()
    gated = _GatedWriter(monkeypatch)
    s.put(NS_A, [3, 4], state_for([3, 4]))
    # the writer is stuck: close gives up after its timeout and reports the loss
    assert s.close(timeout=0.2) is False
    # a leftover temp file, as a kill -9 in the middle of a write leaves it
    (files(s)[0].parent / ".tmp-crash.part").write_bytes(b"partial")
    gated.open()
    _open_stores.pop(tmp_path, None)
    s2 = _new_store(tmp_path, 100_000, 100_000, None, FP)
    try:
        assert s2.contains(NS_A, [1, 2]) == "disk"
        assert list(s2.model_dir.glob("*/.tmp-*")) == []
        s2._check_invariants()
    finally:
        s2.close()


# ---------------------------------------------------------------- shared prefixes (segments)


def put_chain(s, ns, prefix, suffixes, prefix_size=1000, suffix_size=100):
    assert s.put(ns, prefix, state_for(prefix, prefix_size))
    for suf in suffixes:
        toks = prefix + suf
        assert s.parent_length(ns, toks) == len(prefix)
        assert s.put(ns, toks, state_for(suf, suffix_size), base=len(prefix))


def test_segments_store_a_shared_prefix_once(tmp_path):
    s = make_store(tmp_path, ram=100_000, disk=100_000)
    prefix = list(range(10))
    sufs = [[100 + i, 7] for i in range(5)]
    put_chain(s, NS_A, prefix, sufs)
    # bytes grow with unique tokens: one prefix + five 2-token segments
    assert s.ram_used_bytes == 1000 + 4 * 11 + 5 * (100 + 4 * 13)
    with s.acquire(NS_A, prefix + sufs[3] + [9]) as lease:
        assert lease.segments == [(0, state_for(prefix, 1000)), (10, state_for(sufs[3], 100))]
        assert (lease.length, lease.entry_tokens) == (12, 12)
    with s.acquire(NS_A, prefix + [55]) as lease:  # the parent alone
        assert lease.segments == [(0, state_for(prefix, 1000))] and lease.length == 10
    s.flush_to_disk()
    s._check_invariants()
    # after a restart the chain comes from disk, file by file (each verified)
    s2 = make_store(tmp_path, ram=100_000, disk=100_000)
    with s2.acquire(NS_A, prefix + sufs[1]) as lease:
        assert lease.tier == "disk"
        assert lease.segments == [(0, state_for(prefix, 1000)), (10, state_for(sufs[1], 100))]
    assert s2.stats.promotions == 2  # the chain is in RAM now
    with s2.acquire(NS_A, prefix + sufs[1]) as lease:
        assert lease.tier == "ram"
    s2._check_invariants()


def test_a_parent_is_evicted_only_after_its_segments(tmp_path):
    events: list[StoreChange] = []
    s = make_store(tmp_path, ram=1000 + 44 + 3 * 152, disk=0, events=events)
    prefix = list(range(10))
    put_chain(s, NS_A, prefix, [[100 + i, 7] for i in range(3)])
    s.put(NS_B, [1], state_for([1], 300))  # needs room: segments go first, LRU order
    assert s.contains(NS_A, prefix) == "ram"
    assert s.contains(NS_A, prefix + [100, 7]) is None
    s._check_invariants()
    s.put(NS_B, [2], state_for([2], 900))  # now the parent goes too (after its last segment)
    assert s.contains(NS_A, prefix) is None
    assert all(s.contains(NS_A, prefix + [100 + i, 7]) is None for i in range(3))
    removed = [e.tokens for e in events if e.kind == "remove"]
    assert removed.index(tuple(prefix)) == len(removed) - 1
    s._check_invariants()


def test_segment_without_its_parent_is_useless_and_removed(tmp_path, caplog):
    s = make_store(tmp_path, ram=100_000, disk=100_000)
    prefix = list(range(10))
    put_chain(s, NS_A, prefix, [[100, 7], [101, 7]])
    s.flush_to_disk()
    parent_file = s._disk.get(s._key(NS_A, prefix)).payload.path
    # damaged parent: found on first load, the whole chain is dropped (a miss, no error)
    _damage(parent_file, "flip-payload")
    s2 = make_store(tmp_path, ram=100_000, disk=100_000)
    assert s2.acquire(NS_A, prefix + [100, 7]) is None
    assert s2.contains(NS_A, prefix + [101, 7]) is None and len(files(s2)) == 0
    s2._check_invariants()
    # missing parent file: its segments are refused at start
    s3 = make_store(tmp_path, ram=100_000, disk=100_000)
    put_chain(s3, NS_A, prefix, [[100, 7]])
    s3.flush_to_disk()
    s3._disk.get(s3._key(NS_A, prefix)).payload.path.unlink()
    s4 = make_store(tmp_path, ram=100_000, disk=100_000)
    assert s4.prefixes() == [] and files(s4) == []
    assert "segment whose parent state is missing" in caplog.text


def test_remove_takes_the_segments_along(tmp_path):
    s = make_store(tmp_path, ram=100_000, disk=100_000)
    prefix = list(range(10))
    put_chain(s, NS_A, prefix, [[100, 7], [101, 7]])
    lease = s.acquire(NS_A, prefix + [100, 7])
    with pytest.raises(KVStoreError, match="in use"):
        s.remove(NS_A, prefix)
    lease.release()
    assert s.remove(NS_A, prefix)
    assert s.prefixes() == []
    assert s.wait_written()
    s._check_invariants()


def test_rebase_moves_a_longer_state_onto_a_new_branch_point(tmp_path):
    s = make_store(tmp_path, ram=100_000, disk=100_000)
    long = list(range(20))
    assert s.put(NS_A, long, state_for(long, 2000))
    # a second prompt diverges after 10 tokens: the branch point becomes an entry
    assert s.branch_point(NS_A, long[:10] + [99, 98]) == (10, tuple(long), 0)
    assert s.put(NS_A, long[:10], state_for(long[:10], 1000))
    assert s.put(NS_A, long[:10] + [99, 98], state_for([99, 98], 100), base=10)
    assert s.rebase(NS_A, long, 10, state_for(long[10:], 1000))
    assert s.ram_used_bytes == (1000 + 44) + (100 + 52) + (1000 + 84)
    with s.acquire(NS_A, long) as lease:
        assert lease.segments == [(0, state_for(long[:10], 1000)),
                                  (10, state_for(long[10:], 1000))]
    assert s.wait_written()
    s._check_invariants()
    s2 = make_store(tmp_path, ram=100_000, disk=100_000)
    with s2.acquire(NS_A, long) as lease:
        assert lease.tier == "disk" and [b for b, _ in lease.segments] == [0, 10]
        assert lease.segments[1][1] == state_for(long[10:], 1000)
    s2._check_invariants()
