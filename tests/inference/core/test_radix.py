"""Tests for prefixmesh.inference.core.radix: unit tests plus a stateful model-based test that
drives RadixTree and a brute-force reference implementation side by side."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from prefixmesh.inference.core.radix import (
    CapacityError,
    Entry,
    EntryPinnedError,
    InvalidSizeError,
    InvalidTokensError,
    Match,
    NotPinnedError,
    RadixError,
    RadixTree,
    ReentrancyError,
    UnknownEntryError,
    as_tokens,
)


def make_tree(capacity: int = 1000) -> tuple[RadixTree, list[tuple[int, ...]]]:
    evicted: list[tuple[int, ...]] = []

    def on_evict(entry: Entry) -> None:
        assert entry.pins == 0, "a pinned entry was evicted"
        assert not entry.stored
        evicted.append(entry.tokens)

    return RadixTree(capacity, on_evict=on_evict), evicted


def count_nodes(tree: RadixTree) -> int:
    stack, n = [tree._root], 0
    while stack:
        node = stack.pop()
        n += 1
        stack.extend(node.children.values())
    return n


# ---------------------------------------------------------------------- basics


def test_insert_get_len_used_bytes():
    tree, evicted = make_tree()
    a = tree.insert([1, 2, 3], "a", 10)
    b = tree.insert((1, 2, 4), "b", 20)
    assert isinstance(a, Entry) and a.tokens == (1, 2, 3) and a.payload == "a"
    assert tree.get([1, 2, 3]) is a and tree.get([1, 2, 4]) is b
    assert tree.get([1, 2]) is None and tree.get([1, 2, 3, 4]) is None
    assert len(tree) == 2 and tree.used_bytes == 30 and tree.capacity_bytes == 1000
    assert set(map(id, tree.entries())) == {id(a), id(b)}
    assert evicted == []
    tree._check_invariants()


def test_match_exact_mid_edge_divergent_and_longer():
    tree, _ = make_tree()
    e = tree.insert([1, 2, 3, 4, 5], "x", 1)
    assert tree.match([1, 2, 3, 4, 5]) == Match(5, e)
    assert tree.match([1, 2, 3, 4, 5, 6, 7]) == Match(5, e)  # longer than the entry
    assert tree.match([1, 2, 3]) == Match(3, e)  # ends inside the entry's edge
    assert tree.match([1, 2, 9, 9]) == Match(2, e)  # diverges inside the edge
    assert tree.match([2, 1]) == Match(0, None)
    assert tree.match([]) == Match(0, None)


def test_match_on_empty_tree():
    tree, _ = make_tree()
    assert tree.match([1, 2, 3]) == Match(0, None)
    assert tree.get([1]) is None and tree.remove([1]) is None


def test_match_length_counts_any_entry_and_picks_shortest_covering_entry():
    tree, _ = make_tree()
    short = tree.insert([1, 2], "short", 1)
    long_ = tree.insert([1, 2, 3, 4, 5, 6], "long", 1)
    # length 4 comes from the long entry, and only it starts with the matched prefix.
    assert tree.match([1, 2, 3, 4, 9]) == Match(4, long_)
    # both start with [1, 2]: the shorter one is handed out.
    assert tree.match([1, 2, 7]) == Match(2, short)
    assert tree.match([1, 8]) == Match(1, short)


def test_match_ties_go_to_most_recently_used():
    tree, _ = make_tree()
    x = tree.insert([5, 1, 1], "x", 1)
    y = tree.insert([5, 2, 2], "y", 1)
    assert tree.match([5, 9]) == Match(1, y)  # y inserted last
    assert tree.match([5, 1, 1]) == Match(3, x)  # uses x
    assert tree.match([5, 9]) == Match(1, x)
    tree.match([5, 2])
    assert tree.match([5]) == Match(1, y)
    tree._check_invariants()


def test_negative_pseudo_tokens_separate_namespaces():
    tree, _ = make_tree()
    a = tree.insert([-1, 10, 11, 12], "ns-a", 1)
    b = tree.insert([-2, 10, 11, 12], "ns-b", 1)
    assert tree.match([-1, 10, 11]) == Match(3, a)
    assert tree.match([-2, 10, 11, 12]) == Match(4, b)
    assert tree.match([-3, 10, 11]) == Match(0, None)


def test_get_does_not_touch_but_match_does():
    tree, evicted = make_tree(30)
    tree.insert([1], "a", 10)
    tree.insert([2], "b", 10)
    tree.insert([3], "c", 10)
    tree.get([1])  # no LRU effect: [1] stays the oldest
    tree.match([2, 5])  # [2] becomes the newest
    tree.insert([4], "d", 10)
    assert evicted == [(1,)]
    tree.insert([5], "e", 10)
    assert evicted == [(1,), (3,)]
    tree._check_invariants()


# ---------------------------------------------------------------------- insert / replace


def test_insert_same_tokens_replaces_payload_without_callback():
    tree, evicted = make_tree(100)
    e = tree.insert([1, 2], "old", 10)
    tree.pin(e)
    again = tree.insert([1, 2], "new", 25)
    assert again is e and e.payload == "new" and e.size_bytes == 25 and e.pins == 1
    assert len(tree) == 1 and tree.used_bytes == 25 and evicted == []
    tree.unpin(e)
    tree._check_invariants()


def test_replacement_growth_evicts_others_but_never_itself():
    tree, evicted = make_tree(30)
    e = tree.insert([1], "e", 10)
    tree.insert([2], "f", 10)
    tree.insert([3], "g", 10)
    # [1] is the LRU entry, but it is the one being replaced: [2] and [3] go instead.
    assert tree.insert([1], "e2", 30) is e
    assert evicted == [(2,), (3,)] and tree.used_bytes == 30 and e.payload == "e2"
    tree._check_invariants()


def test_replacement_that_cannot_fit_changes_nothing():
    tree, evicted = make_tree(30)
    e = tree.insert([1], "e", 10)
    other = tree.insert([2], "f", 10)
    last_used = e.last_used
    assert tree.insert([1], "huge", 31) is None
    assert e.payload == "e" and e.size_bytes == 10 and e.last_used == last_used
    assert evicted == [] and tree.used_bytes == 20 and tree.get([2]) is other
    tree._check_invariants()


def test_insert_too_big_returns_none_and_evicts_nothing():
    tree, evicted = make_tree(50)
    tree.insert([1], "a", 20)
    tree.insert([2], "b", 20)
    assert tree.insert([3], "c", 51) is None
    assert evicted == [] and len(tree) == 2 and tree.get([3]) is None


def test_insert_returns_none_when_the_rest_is_pinned():
    tree, evicted = make_tree(50)
    a = tree.insert([1], "a", 20)
    tree.insert([2], "b", 20)
    tree.pin(a)
    assert tree.insert([3], "c", 40) is None  # only 20 evictable bytes, 30 needed
    assert evicted == [] and len(tree) == 2
    assert tree.insert([3], "c", 30) is not None  # evicts b exactly
    assert evicted == [(2,)] and tree.used_bytes == 50
    tree._check_invariants()


def test_lru_eviction_order_and_callbacks():
    tree, evicted = make_tree(40)
    for t in range(4):
        tree.insert([t, t], f"p{t}", 10)
    tree.match([0, 0])  # order now: 1, 2, 3, 0
    tree.insert([9], "big", 25)
    assert evicted == [(1, 1), (2, 2), (3, 3)]
    assert tree.used_bytes == 35 and tree.used_bytes <= tree.capacity_bytes
    tree._check_invariants()


def test_zero_size_entries_and_zero_capacity():
    tree, evicted = make_tree(0)
    e = tree.insert([1, 2], "free", 0)
    assert e is not None and tree.used_bytes == 0
    assert tree.insert([3], "x", 1) is None and evicted == []


# ---------------------------------------------------------------------- pins


def test_pinned_entries_are_never_evicted():
    tree, evicted = make_tree(30)
    a = tree.insert([1], "a", 10)
    tree.insert([2], "b", 10)
    tree.insert([3], "c", 10)
    with tree.pinned(a) as held:
        assert held is a and a.pins == 1 and tree.pinned_bytes == 10
        assert tree.insert([4], "d", 20) is not None
        assert evicted == [(2,), (3,)]
        assert tree.evict(1000) == 20 and a.stored
    assert a.pins == 0 and tree.pinned_bytes == 0
    assert tree.evict(1) == 10 and evicted[-1] == (1,)
    tree._check_invariants()


def test_pins_are_refcounted():
    tree, _ = make_tree(10)
    a = tree.insert([1], "a", 10)
    tree.pin(a)
    tree.pin(a)
    tree.unpin(a)
    assert tree.evict(10) == 0
    tree.unpin(a)
    assert tree.evict(10) == 10
    with pytest.raises(UnknownEntryError):
        tree.unpin(a)


def test_unpin_without_pin_raises():
    tree, _ = make_tree()
    a = tree.insert([1], "a", 1)
    with pytest.raises(NotPinnedError, match="not pinned"):
        tree.unpin(a)


def test_pin_of_removed_or_foreign_entry_raises():
    tree, _ = make_tree()
    other, _ = make_tree()
    a = tree.insert([1], "a", 1)
    foreign = other.insert([1], "a", 1)
    with pytest.raises(UnknownEntryError, match="another tree"):
        tree.pin(foreign)
    tree.remove([1])
    with pytest.raises(UnknownEntryError, match="evicted or removed"):
        tree.pin(a)
    with pytest.raises(UnknownEntryError):
        tree.pin("not an entry")  # type: ignore[arg-type]


def test_pinned_context_manager_unpins_on_error():
    tree, _ = make_tree()
    a = tree.insert([1], "a", 1)
    with pytest.raises(RuntimeError), tree.pinned(a):
        raise RuntimeError("boom")
    assert a.pins == 0


def test_a_reused_entry_outlives_newer_entries_nobody_came_back_for():
    # LRU-2: one-off prompts go before a state that was asked for again, however recent
    tree, evicted = make_tree(30)
    tree.insert([1], "reused", 10)
    tree.match([1, 7])  # asked for again
    tree.insert([2], "once", 10)
    tree.insert([3], "once", 10)
    tree.insert([4], "once", 10)  # plain LRU would evict [1]: its last use is the oldest
    assert evicted == [(2,)]
    tree.insert([5], "once", 10)
    assert evicted == [(2,), (3,)]
    tree.match([4])
    tree.match([5])  # now three reused entries: the one whose use before the last is oldest
    tree.insert([6], "once", 10)
    assert evicted == [(2,), (3,), (1,)]
    tree._check_invariants()


def test_lru_order_survives_pin_unpin():
    tree, evicted = make_tree(30)
    a = tree.insert([1], "a", 10)
    tree.insert([2], "b", 10)
    tree.insert([3], "c", 10)
    tree.pin(a)
    tree.unpin(a)  # unpinning is not a use: a is still the LRU entry
    tree.insert([4], "d", 10)
    assert evicted == [(1,)]


# ---------------------------------------------------------------------- remove / evict / capacity


def test_remove_calls_on_evict_and_refuses_pinned():
    tree, evicted = make_tree()
    a = tree.insert([1, 2, 3], "a", 5)
    b = tree.insert([1, 2], "b", 5)
    tree.pin(a)
    with pytest.raises(EntryPinnedError):
        tree.remove([1, 2, 3])
    tree.unpin(a)
    assert tree.remove([1, 2, 3]) is a and evicted == [(1, 2, 3)] and not a.stored
    assert tree.remove([1, 2, 3]) is None
    assert tree.match([1, 2, 3]) == Match(2, b)
    assert tree.used_bytes == 5 and len(tree) == 1
    tree._check_invariants()


def test_removal_prunes_and_merges_nodes():
    tree, _ = make_tree()
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2], [1, 2, 6, 7], [8]]
    for s in seqs:
        tree.insert(s, None, 1)
    tree._check_invariants()
    assert count_nodes(tree) <= 2 * len(tree) + 1
    tree.remove([1, 2])
    tree.remove([1, 2, 3, 4])
    tree._check_invariants()
    # [1,2,3,5] and [1,2,6,7] remain below one branching node [1,2]
    assert count_nodes(tree) == 1 + 1 + 2 + 1
    for s in seqs:
        tree.remove(s)
    assert count_nodes(tree) == 1 and len(tree) == 0 and tree.used_bytes == 0
    tree._check_invariants()


def test_evict_frees_at_least_n_bytes_or_everything_unpinned():
    tree, evicted = make_tree()
    for t in range(5):
        tree.insert([t], t, 10)
    assert tree.evict(0) == 0 and evicted == []
    assert tree.evict(15) == 20 and evicted == [(0,), (1,)]
    tree.pin(tree.get([4]))
    assert tree.evict(100) == 20 and evicted == [(0,), (1,), (2,), (3,)]
    assert len(tree) == 1
    with pytest.raises(InvalidSizeError):
        tree.evict(-1)


def test_set_capacity_shrinks_by_evicting_and_refuses_below_pinned():
    tree, evicted = make_tree(100)
    a = tree.insert([1], "a", 30)
    tree.insert([2], "b", 30)
    tree.insert([3], "c", 30)
    tree.pin(a)
    tree.set_capacity(40)
    assert evicted == [(2,), (3,)] and tree.capacity_bytes == 40 and tree.used_bytes == 30
    with pytest.raises(CapacityError, match="pinned"):
        tree.set_capacity(29)
    assert tree.capacity_bytes == 40 and len(tree) == 1
    tree.set_capacity(1000)
    assert tree.capacity_bytes == 1000


def test_entries_is_a_snapshot():
    tree, _ = make_tree()
    for t in range(5):
        tree.insert([t, 1], t, 1)
    for e in tree.entries():
        tree.remove(e.tokens)
    assert len(tree) == 0 and list(tree.entries()) == []


def test_callback_may_read_but_not_modify():
    seen: list[tuple[int, Match]] = []
    tree: RadixTree

    def reader(entry: Entry) -> None:
        seen.append((len(tree), tree.match(entry.tokens)))

    tree = RadixTree(10, on_evict=reader)
    tree.insert([1, 2], "a", 10)
    tree.insert([1, 3], "b", 10)  # evicts [1, 2]; the callback sees the tree without it
    assert seen[0][0] == 0 and seen[0][1] == Match(0, None)

    def writer(entry: Entry) -> None:
        tree.insert([7], "x", 1)

    tree = RadixTree(10, on_evict=writer)
    tree.insert([1], "a", 10)
    with pytest.raises(ReentrancyError, match="insert"):
        tree.insert([2], "b", 10)
    assert tree.get([1]) is None and tree.used_bytes == 0  # consistent after the error
    tree._check_invariants()
    assert tree.insert([3], "c", 5) is not None  # the tree still works


# ---------------------------------------------------------------------- validation


@pytest.mark.parametrize("tokens", [[], ()])
def test_insert_rejects_empty(tokens):
    tree, _ = make_tree()
    with pytest.raises(InvalidTokensError, match="empty"):
        tree.insert(tokens, "x", 1)


@pytest.mark.parametrize("tokens", ["abc", b"abc", [1, 2.0], [1, None]])
def test_rejects_non_int_tokens(tokens):
    tree, _ = make_tree()
    with pytest.raises(InvalidTokensError):
        tree.insert(tokens, "x", 1)
    with pytest.raises(InvalidTokensError):
        tree.match(tokens)


@pytest.mark.parametrize("size", [-1, 1.5, "3", None])
def test_rejects_bad_sizes(size):
    tree, _ = make_tree()
    with pytest.raises(InvalidSizeError):
        tree.insert([1], "x", size)
    with pytest.raises(InvalidSizeError):
        RadixTree(size)
    assert len(tree) == 0


def test_errors_share_a_base_and_value_errors_are_value_errors():
    for exc in (InvalidTokensError, InvalidSizeError, UnknownEntryError):
        assert issubclass(exc, RadixError) and issubclass(exc, ValueError)
    for exc in (NotPinnedError, EntryPinnedError, CapacityError, ReentrancyError):
        assert issubclass(exc, RadixError)


def test_index_like_tokens_are_normalised_to_ints():
    class Tok:
        def __init__(self, v: int) -> None:
            self.v = v

        def __index__(self) -> int:
            return self.v

    tree, _ = make_tree()
    e = tree.insert([Tok(1), Tok(2)], "x", 1)
    assert e.tokens == (1, 2) and type(e.tokens[0]) is int
    assert tree.match([1, 2, 3]) == Match(2, e)


def test_lru_heap_stays_bounded_under_many_touches():
    tree, _ = make_tree()
    for t in range(10):
        tree.insert([t, 0], t, 1)
    for i in range(5000):
        tree.match([i % 10, 0])
    assert len(tree._heap) <= 2 * len(tree) + 33
    tree._check_invariants()


def test_long_shared_prefixes():
    tree, _ = make_tree(10**9)
    system = list(range(1000, 1500))
    entries = [tree.insert([-1, *system, *range(u, u + 100)], u, 100) for u in range(0, 2000, 100)]
    tree._check_invariants()
    query = [-1, *system, *range(700, 750), 5]
    assert tree.match(query) == Match(1 + 500 + 50, entries[7])
    assert tree.match([-1, *system[:300], 0]) == Match(301, entries[7])  # most recently used
    assert tree.match([-1, *system[:300]]).entry is entries[7]


# ---------------------------------------------------------------------- model-based test


@dataclass
class RefEntry:
    tokens: tuple[int, ...]
    payload: object
    size: int
    pins: int = 0
    used_at: list[int] = field(default_factory=list)  # every use, oldest first

    @property
    def last_used(self) -> int:
        return self.used_at[-1] if self.used_at else 0


class Reference:
    """Brute force: a dict of token tuples, linear scans for matching and for LRU-2 (the
    entries used once go first, oldest first; then the others by their second-last use)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: dict[tuple[int, ...], RefEntry] = {}
        self.clock = 0
        self.evicted: list[tuple[int, ...]] = []

    @property
    def used(self) -> int:
        return sum(e.size for e in self.entries.values())

    def touch(self, e: RefEntry) -> None:
        self.clock += 1
        e.used_at.append(self.clock)

    def evict_one(self, exclude: tuple[int, ...] | None = None) -> RefEntry | None:
        victims = [e for e in self.entries.values() if e.pins == 0 and e.tokens != exclude]
        if not victims:
            return None
        victim = min(victims, key=lambda e: (len(e.used_at) > 1, e.used_at[-min(2, len(e.used_at))]))
        del self.entries[victim.tokens]
        self.evicted.append(victim.tokens)
        return victim

    def insert(self, tokens, payload, size):
        existing = self.entries.get(tokens)
        old = existing.size if existing else 0
        evictable = sum(e.size for e in self.entries.values() if e.pins == 0 and e.tokens != tokens)
        if self.used - old + size - self.capacity > evictable:
            return None
        while self.used - old + size > self.capacity:
            self.evict_one(exclude=tokens)
        if existing is None:
            existing = self.entries[tokens] = RefEntry(tokens, payload, size)
        existing.payload, existing.size = payload, size
        self.touch(existing)
        return existing

    def match(self, query):
        def lcp(a, b):
            n = 0
            for x, y in zip(a, b, strict=False):
                if x != y:
                    break
                n += 1
            return n

        length = max((lcp(t, query) for t in self.entries), default=0)
        if length == 0:
            return 0, None
        covering = [e for t, e in self.entries.items() if t[:length] == query[:length]]
        best = min(covering, key=lambda e: (len(e.tokens), -e.last_used))
        self.touch(best)
        return length, best

    def evict(self, n):
        freed = 0
        while freed < n:
            victim = self.evict_one()
            if victim is None:
                break
            freed += victim.size
        return freed


TOKENS = st.lists(st.sampled_from([-1, 0, 1, 2]), min_size=1, max_size=6).map(tuple)
QUERY = st.lists(st.sampled_from([-1, 0, 1, 2, 3]), min_size=0, max_size=7).map(tuple)
SIZES = st.integers(min_value=0, max_value=30)


class RadixMachine(RuleBasedStateMachine):
    @initialize(capacity=st.integers(min_value=0, max_value=100))
    def setup(self, capacity):
        self.ref = Reference(capacity)
        self.evicted: list[tuple[int, ...]] = []
        self.payload_seq = 0

        def on_evict(entry: Entry) -> None:
            assert entry.pins == 0, "pinned entry evicted"
            self.evicted.append(entry.tokens)

        self.tree = RadixTree(capacity, on_evict=on_evict)

    def next_payload(self):
        self.payload_seq += 1
        return self.payload_seq

    @rule(tokens=TOKENS, size=SIZES)
    def insert(self, tokens, size):
        payload = self.next_payload()
        got = self.tree.insert(tokens, payload, size)
        want = self.ref.insert(tokens, payload, size)
        assert (got is None) == (want is None)
        if got is not None:
            assert got.tokens == tokens and got.payload == payload and got.size_bytes == size

    @rule(query=QUERY)
    def match(self, query):
        length, entry = self.tree.match(query)
        want_length, want_entry = self.ref.match(query)
        assert length == want_length
        if want_entry is None:
            assert entry is None
        else:
            assert entry is not None and entry.tokens == want_entry.tokens
            assert entry.tokens[:length] == query[:length]

    @rule(query=QUERY)
    def get(self, query):
        got = self.tree.get(query)
        want = self.ref.entries.get(query)
        assert (got is None) == (want is None)
        if got is not None:
            assert got.payload == want.payload

    @rule(query=QUERY)
    def remove(self, query):
        want = self.ref.entries.get(query)
        if want is not None and want.pins:
            with pytest.raises(EntryPinnedError):
                self.tree.remove(query)
            return
        got = self.tree.remove(query)
        assert (got is None) == (want is None)
        if want is not None:
            del self.ref.entries[query]
            self.ref.evicted.append(query)
            assert not got.stored

    @precondition(lambda self: self.ref.entries)
    @rule(data=st.data())
    def pin(self, data):
        tokens = data.draw(st.sampled_from(sorted(self.ref.entries)))
        self.tree.pin(self.tree.get(tokens))
        self.ref.entries[tokens].pins += 1

    @precondition(lambda self: any(e.pins for e in self.ref.entries.values()))
    @rule(data=st.data())
    def unpin(self, data):
        pinned = sorted(t for t, e in self.ref.entries.items() if e.pins)
        tokens = data.draw(st.sampled_from(pinned))
        self.tree.unpin(self.tree.get(tokens))
        self.ref.entries[tokens].pins -= 1

    @rule(query=QUERY)
    def unpin_unpinned_raises(self, query):
        entry = self.tree.get(query)
        if entry is not None and entry.pins == 0:
            with pytest.raises(NotPinnedError):
                self.tree.unpin(entry)

    @rule(n=st.integers(min_value=0, max_value=60))
    def evict(self, n):
        assert self.tree.evict(n) == self.ref.evict(n)

    @rule(capacity=st.integers(min_value=0, max_value=120))
    def set_capacity(self, capacity):
        pinned = sum(e.size for e in self.ref.entries.values() if e.pins)
        if pinned > capacity:
            with pytest.raises(CapacityError):
                self.tree.set_capacity(capacity)
            return
        self.tree.set_capacity(capacity)
        self.ref.capacity = capacity
        while self.ref.used > capacity:
            assert self.ref.evict_one() is not None

    @invariant()
    def agrees_with_reference(self):
        tree, ref = self.tree, self.ref
        tree._check_invariants()
        assert self.evicted == ref.evicted
        assert tree.used_bytes == ref.used <= tree.capacity_bytes == ref.capacity
        assert len(tree) == len(ref.entries)
        got = {e.tokens: (e.payload, e.size_bytes, e.pins, e.last_used) for e in tree.entries()}
        want = {t: (e.payload, e.size, e.pins, e.last_used) for t, e in ref.entries.items()}
        assert got == want


RadixMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_radix_against_reference = RadixMachine.TestCase


@settings(max_examples=200, deadline=None)
@given(
    stored=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), max_size=12),
    query=st.lists(st.integers(0, 3), max_size=8),
)
def test_longest_prefix_entry_matches_a_brute_force_scan(stored, query):
    tree = RadixTree(1 << 20)
    for toks in stored:
        tree.insert(toks, None, 1)
    q = tuple(query)
    prefixes = [e for e in tree.entries() if q[: len(e.tokens)] == e.tokens]
    got = tree.longest_prefix_entry(q)
    if not prefixes:
        assert got is None
    else:
        assert got is max(prefixes, key=lambda e: len(e.tokens))
    before = [e.last_used for e in tree.entries()]
    tree.longest_prefix_entry(q)
    assert [e.last_used for e in tree.entries()] == before  # no LRU touch


@settings(max_examples=100, deadline=None)
@given(stored=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), max_size=8),
       query=st.lists(st.integers(0, 3), max_size=10))
def test_key_methods_answer_as_the_public_ones(stored, query) -> None:
    """``match_key`` / ``get_key`` / ``longest_prefix_entry_key`` / ``insert_key`` on
    ``as_tokens(...)`` give what the converting methods give (two trees, same calls)."""
    public, keyed = RadixTree(1000), RadixTree(1000)
    for tokens in stored:
        a = public.insert(tokens, "p", len(tokens))
        b = keyed.insert_key(as_tokens(tokens), "p", len(tokens))
        assert (a is None) == (b is None)
    key = as_tokens(query)

    def tokens_of(entry):
        return entry.tokens if entry is not None else None

    assert tokens_of(public.get(query)) == tokens_of(keyed.get_key(key))
    assert (tokens_of(public.longest_prefix_entry(query))
            == tokens_of(keyed.longest_prefix_entry_key(key)))
    mp, mk = public.match(query), keyed.match_key(key)
    assert mp.length == mk.length and tokens_of(mp.entry) == tokens_of(mk.entry)
    assert [e.tokens for e in public.entries()] == [e.tokens for e in keyed.entries()]
    keyed._check_invariants()
