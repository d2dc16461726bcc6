"""SegmentTree (the simulator's KV accounting) against the real KVStore: the same prompts
saved by the engine's rule (``Engine._save_snapshots`` with one point, replayed here on
the store with synthetic payloads of ``bytes_per_token`` per own token) and leased as the
engine leases them must leave the same entries, bases and bytes in RAM."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.inference.core.segments import SegmentTree, ram_entry_bytes
from prefixmesh.inference.kvstore import KVStore

NS = b"n" * 8
BPT = 10
MIN_SHARE = 4


def _engine_save(store: KVStore, tokens: tuple[int, ...]) -> None:
    """Engine._save_snapshots for one point (the whole prompt), payloads synthetic."""
    if store.covered(NS, tokens):
        return
    base = store.parent_length(NS, tokens)
    split, other, other_base = store.branch_point(NS, tokens)
    rebase = None
    if other is not None and split - base >= MIN_SHARE and other_base <= base:
        if store.put(NS, tokens[:split], b"x" * ((split - base) * BPT), base=base):
            if other_base == base:
                rebase = (other, split)
            base = split
    store.put(NS, tokens, b"x" * ((len(tokens) - base) * BPT), base=base)
    if rebase is not None:  # Engine._rebase: lease the other state, then rebase it
        other, split = rebase
        lease = store.acquire(NS, other)
        if lease is not None:
            try:
                if lease.entry_tokens == len(other):
                    store.rebase(NS, other, split, b"x" * ((len(other) - split) * BPT))
            finally:
                lease.release()


def _ram_state(store: KVStore):
    return sorted((e.tokens[1:], e.payload.base, e.size_bytes) for e in store._ram.entries())


def _tree_state(tree: SegmentTree):
    return sorted((e.tokens[1:], e.payload.base, e.size_bytes) for e in tree.tree.entries())


prompts_st = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 12), st.integers(0, 2), st.integers(1, 20)),
    min_size=1, max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(prompts=prompts_st, capacity=st.sampled_from([400, 1500, 6000, 1 << 20]),
       seed=st.integers(0, 100))
def test_segment_tree_keeps_the_stores_entries_and_bytes(prompts, capacity, seed):
    rng = random.Random(seed)
    systems = [tuple(rng.randrange(100) for _ in range(12)) for _ in range(4)]
    store = KVStore(fingerprint=b"f" * 32, ram_budget_bytes=capacity)
    tree = SegmentTree(capacity, BPT, min_share=MIN_SHARE)
    for sys_i, shared, variant, tail in prompts:
        # a system prompt, a shared middle of `shared` tokens, then a variant tail
        tokens = systems[sys_i] + tuple(range(200, 200 + shared)) + tuple(
            1000 * (variant + 1) + i for i in range(tail))
        lease = store.acquire(NS, tokens)  # the request's lookup (a lease)
        if lease is not None:
            lease.release()
        tree.match(tokens)
        _engine_save(store, tokens)
        tree.save(tokens, lambda n: None)
        assert _tree_state(tree) == _ram_state(store)
        assert tree.used_bytes == store.ram_used_bytes
    store.close()


def test_a_shared_prefix_is_charged_once():
    tree = SegmentTree(1 << 20, BPT, min_share=MIN_SHARE)
    system = tuple(range(100))
    tree.save(system + (1, 2, 3), lambda n: n)
    tree.save(system + (7, 8), lambda n: n)  # branch point at 100: rebased
    sizes = {e.tokens[1:]: (e.payload.base, e.size_bytes) for e in tree.tree.entries()}
    assert sizes[system] == (0, ram_entry_bytes(100 * BPT, 101))
    assert sizes[system + (1, 2, 3)] == (100, ram_entry_bytes(3 * BPT, 104))
    assert sizes[system + (7, 8)] == (100, ram_entry_bytes(2 * BPT, 103))
    evicted = []
    small = SegmentTree(ram_entry_bytes(120 * BPT, 250), BPT, min_share=MIN_SHARE,
                        on_evict=lambda tokens, value: evicted.append(len(tokens)))
    small.save(system + (1,) * 10, lambda n: n)
    small.save(system + (2,) * 10, lambda n: n)
    small.save(tuple(range(500, 530)), lambda n: n)  # evicts segments before their parent
    assert evicted and 100 not in evicted[:-1]
