"""A token-id radix tree of cached prompt prefixes, with pinning and LRU-2 eviction to a byte budget.

Each stored *entry* names one token-id sequence (a cached prefix) together with an opaque
payload handle (for the KV store: where the saved sequence state lives) and its size in bytes.
Lookups answer "how long a prefix of this prompt could be served from cache, and which stored
state do I restore (and truncate) to get it".

Design
------
- Compact radix tree: every edge carries a tuple of tokens, children are keyed by the first
  token of their edge. Inserting splits an edge where the new sequence diverges; removing an
  entry prunes a payload-less leaf and merges a payload-less node that is left with a single
  child into that child. Invariant: every non-root node either holds an entry or has at least
  two children, so the tree never holds garbage and every non-root node's subtree holds at
  least one entry.
- Every node caches ``best``: the entry of its subtree that ``match`` should hand out, i.e. the
  shortest one, ties to the most recently used. Because a node's own entry is shorter than any
  entry below it, and entries of equal length live in different branches, this can be kept
  up to date cheaply (see Complexity).
- Uses are counted on a logical clock (``Entry.last_used``, ``prev_used``, ``uses``), bumped by
  ``insert`` and by ``match`` (never by ``get``), so results are deterministic.
- Eviction order is LRU-2 (O'Neil, O'Neil and Weikum, 1993), :func:`eviction_rank`: first the
  entries used once (stored and never asked for again), oldest first; then the entries used
  again, by the time of their use before the last. Plain LRU let a stream of one-off prompts
  push out states that were reused (on the MMLU trace at 512 MiB a node: 0.937-0.957 of the
  ideal hit ratio over three seeds, LRU-2 0.955-0.968; docs/bench/sim.md). The unpinned entry
  with the smallest rank comes from a binary heap with lazy invalidation: stale heap items (the
  entry was used again, pinned, or removed) are skipped when popped, and the heap is rebuilt
  when stale items outnumber live entries.
- Pinning is refcounted. A pinned entry is never evicted, and ``remove`` refuses it
  (``EntryPinnedError``): the pin holder is using its payload.

Semantics worth knowing
-----------------------
- ``match(query)`` returns ``Match(length, entry)``: ``length`` is the longest common prefix of
  ``query`` with *any* stored entry (it may end in the middle of an edge, i.e. inside an entry),
  and ``entry`` is the shortest entry whose tokens start with ``query[:length]`` (ties to the
  most recently used). The caller restores ``entry``'s state and truncates it to ``length``
  tokens. ``entry`` is ``None`` iff ``length == 0``. The chosen entry counts as used.
- ``insert`` of tokens that are already stored replaces payload and size in place (same
  ``Entry`` object, pins kept, no eviction callback for the old payload) and counts as a use.
  If the new item cannot fit even after evicting every other unpinned entry, ``insert`` returns
  ``None`` and changes nothing at all (no eviction, the old payload stays).
- ``on_evict(entry)`` is called, after the entry has left the tree, for every entry removed by
  eviction (``insert``, ``evict``, ``set_capacity``) and by ``remove``. It may read the tree
  (``match``, ``get``, ``entries``) and ``unpin``, but must not ``insert``, ``remove``, ``evict``,
  ``set_capacity`` or ``pin`` (``ReentrancyError``). If it raises, the exception propagates;
  the entry is already gone and the tree is consistent.
- ``set_capacity`` to less than the pinned bytes raises ``CapacityError`` and changes nothing.
- Empty token sequences are rejected by ``insert``; lookups of an empty sequence are well
  defined (``match`` gives ``Match(0, None)``, ``get``/``remove`` give ``None``).
- Tokens are ints (anything ``operator.index`` accepts; negative ints are fine, callers use
  them as namespace pseudo-tokens).

Invariants after every public call: ``used_bytes`` is the sum of the entries' sizes and
``used_bytes <= capacity_bytes``.

Complexity (L = query length, d = nodes on the query's path, d <= L)
---------------------------------------------------------------------
- ``match``: O(L) token comparisons (whole-edge slice compares run at C speed) + O(d) node
  hops + the touch, which walks up only through ancestors whose shortest entry has the same
  length as the chosen one (O(d)).
- ``insert``: O(L + d) + eviction. ``get``: O(L) (a dict keyed by the token tuple).
- Removing one entry (``remove``, or one eviction): O(L) for the dict + O(1) restructuring +
  re-deriving ``best`` for the chain of ancestors whose ``best`` was that entry, each in
  O(fanout); + O(log H) amortised heap work (H <= 2n + 32 heap items).
- ``pin``/``unpin``: O(1) (+ O(log H) for the unpin that makes an entry evictable again).

Memory: one node per entry plus at most one branching node per entry; edges are tuples that
share nothing with each other, so the tree stores each distinct token once per branch, plus the
entries' own token tuples (which the exact-lookup dict also keys on, without copying).

Pure code: no trio, libp2p or llama imports; no clock, no randomness.
"""

from __future__ import annotations

import heapq
import itertools
import operator
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

__all__ = [
    "RadixError",
    "InvalidTokensError",
    "InvalidSizeError",
    "UnknownEntryError",
    "NotPinnedError",
    "EntryPinnedError",
    "CapacityError",
    "ReentrancyError",
    "Entry",
    "Match",
    "RadixTree",
    "as_tokens",
    "eviction_rank",
]


class RadixError(Exception):
    """Base class of every error raised by this module."""


class InvalidTokensError(RadixError, ValueError):
    """A token sequence was empty where that is not allowed, or held something not an int."""


class InvalidSizeError(RadixError, ValueError):
    """A size, capacity or byte count was negative or not an int."""


class UnknownEntryError(RadixError, ValueError):
    """The entry is not (or no longer) stored in this tree."""


class NotPinnedError(RadixError):
    """``unpin`` of an entry whose pin count is already zero."""


class EntryPinnedError(RadixError):
    """``remove`` of an entry that is pinned (in use)."""


class CapacityError(RadixError):
    """``set_capacity`` below the bytes held by pinned entries."""


class ReentrancyError(RadixError):
    """An ``on_evict`` callback tried to modify the tree."""


class Entry:
    """One cached prefix. Compared by identity. Fields are read-only for callers.

    ``tokens``: the token ids; ``payload``: the caller's handle; ``size_bytes``: its size;
    ``pins``: current pin count; ``last_used`` / ``prev_used``: logical clock of its last use
    and of the use before (0: none); ``uses``: how often it was used (its insert included).
    """

    __slots__ = ("tokens", "payload", "size_bytes", "pins", "last_used", "prev_used", "uses",
                 "_tree", "_node")

    def __init__(self, tokens: tuple[int, ...], payload: object, size_bytes: int) -> None:
        self.tokens = tokens
        self.payload = payload
        self.size_bytes = size_bytes
        self.pins = 0
        self.last_used = 0
        self.prev_used = 0
        self.uses = 0
        self._tree: RadixTree | None = None
        self._node: _Node | None = None

    @property
    def stored(self) -> bool:
        """Whether the entry is still held by a tree (False once evicted or removed)."""
        return self._tree is not None

    def __repr__(self) -> str:
        head = ", ".join(map(str, self.tokens[:4])) + (", ..." if len(self.tokens) > 4 else "")
        return (
            f"Entry(tokens=({head}) len={len(self.tokens)}, size_bytes={self.size_bytes}, "
            f"pins={self.pins}, last_used={self.last_used}, stored={self.stored})"
        )


class Match(NamedTuple):
    length: int  # longest common prefix of the query with ANY stored entry
    entry: Entry | None  # shortest entry starting with query[:length], ties -> most recently used


class _Node:
    # key: the edge's tokens from the parent; best: shortest entry in the subtree, ties to the
    # most recently used (None only for the root of an empty tree).
    __slots__ = ("key", "children", "parent", "entry", "best")

    def __init__(self, key: tuple[int, ...], parent: _Node | None) -> None:
        self.key = key
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.entry: Entry | None = None
        self.best: Entry | None = None


_CHUNK = 32  # tokens compared per slice while locating a mismatch inside an edge


def _common_prefix(key: tuple[int, ...], query: tuple[int, ...], start: int) -> int:
    """Length of the common prefix of ``key`` and ``query[start:]``."""
    n = len(key)
    segment = query[start : start + n]
    if segment == key:
        return n
    limit = len(segment)
    i = 0
    # Skip equal chunks with C-speed slice compares, then finish token by token.
    while i + _CHUNK <= limit and key[i : i + _CHUNK] == segment[i : i + _CHUNK]:
        i += _CHUNK
    while i < limit and key[i] == segment[i]:
        i += 1
    return i


def as_tokens(tokens: Sequence[int]) -> tuple[int, ...]:
    """``tokens`` as the tree keys them (a tuple of ints); a clear error for anything else."""
    if isinstance(tokens, str | bytes | bytearray | memoryview):
        raise InvalidTokensError(f"tokens must be a sequence of ints, not {type(tokens).__name__}")
    try:
        return tuple(map(operator.index, tokens))
    except TypeError as exc:
        raise InvalidTokensError(f"tokens must be a sequence of ints: {exc}") from None


def _as_byte_count(value: int, what: str) -> int:
    try:
        count = operator.index(value)
    except TypeError:
        raise InvalidSizeError(f"{what} must be an int, got {type(value).__name__}") from None
    if count < 0:
        raise InvalidSizeError(f"{what} must be >= 0, got {count}")
    return count


def eviction_rank(entry: Entry) -> tuple[int, int]:
    """Where ``entry`` stands in the eviction order, smallest first (module docstring: LRU-2):
    used once, by its only use; used again, after all of those, by its use before the last."""
    if entry.uses < 2:
        return (0, entry.last_used)
    return (1, entry.prev_used)


def _better(a: Entry, b: Entry | None) -> bool:
    """Whether ``a`` is a better ``match`` answer than ``b``: shorter, or as short and newer."""
    if b is None:
        return True
    la, lb = len(a.tokens), len(b.tokens)
    return la < lb or (la == lb and a.last_used > b.last_used)


class RadixTree:
    """Token-id radix tree of cached prefixes with refcounted pins and LRU-2 eviction.

    See the module docstring for semantics and complexity.
    """

    def __init__(
        self, capacity_bytes: int, on_evict: Callable[[Entry], None] | None = None
    ) -> None:
        self._capacity = _as_byte_count(capacity_bytes, "capacity_bytes")
        self._on_evict = on_evict
        self._root = _Node((), None)
        self._entries: dict[tuple[int, ...], Entry] = {}
        self._used = 0
        self._unpinned_bytes = 0  # bytes eviction could free
        self._clock = 0  # logical clock of uses
        # (eviction_rank, push seq, last_used then, entry), lazily invalidated
        self._heap: list[tuple[tuple[int, int], int, int, Entry]] = []
        self._push_seq = itertools.count()
        self._in_callback = False

    # ------------------------------------------------------------------ properties

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def pinned_bytes(self) -> int:
        """Bytes held by pinned entries (eviction cannot free them)."""
        return self._used - self._unpinned_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return (
            f"RadixTree(entries={len(self._entries)}, used_bytes={self._used}, "
            f"capacity_bytes={self._capacity}, pinned_bytes={self.pinned_bytes})"
        )

    # ------------------------------------------------------------------ public API

    def set_capacity(self, capacity_bytes: int) -> None:
        """Change the byte budget; shrinking evicts unpinned entries in eviction order."""
        self._check_not_in_callback("set_capacity")
        capacity = _as_byte_count(capacity_bytes, "capacity_bytes")
        if self.pinned_bytes > capacity:
            raise CapacityError(
                f"cannot shrink capacity to {capacity} bytes: {self.pinned_bytes} bytes are pinned"
            )
        self._capacity = capacity
        self._evict_down_to(capacity)

    def insert(self, tokens: Sequence[int], payload: object, size_bytes: int) -> Entry | None:
        """Store ``payload`` for exactly ``tokens``; see the module docstring.

        Returns the entry (an existing one for the same tokens is updated in place), or
        ``None`` if the item cannot fit; in that case nothing changes.
        """
        self._check_not_in_callback("insert")  # before the tokens' check, as always
        return self.insert_key(as_tokens(tokens), payload, size_bytes)

    def insert_key(self, key: tuple[int, ...], payload: object, size_bytes: int) -> Entry | None:
        """``insert`` of a key already in the tree's form (see :meth:`match_key`)."""
        self._check_not_in_callback("insert")
        if not key:
            raise InvalidTokensError("cannot insert an empty token sequence")
        size = _as_byte_count(size_bytes, "size_bytes")

        existing = self._entries.get(key)
        old_size = existing.size_bytes if existing is not None else 0
        over = self._used - old_size + size - self._capacity
        if over > 0:
            evictable = self._unpinned_bytes
            if existing is not None and existing.pins == 0:
                evictable -= old_size  # the entry being replaced is not a victim
            if over > evictable:
                return None
            if existing is not None:
                # Shield the entry being replaced from its own insert's eviction.
                self._pin_internal(existing)
                try:
                    self._evict_down_to(self._capacity - size + old_size)
                finally:
                    self._unpin_internal(existing)
            else:
                self._evict_down_to(self._capacity - size)

        if existing is not None:
            self._used += size - old_size
            if existing.pins == 0:
                self._unpinned_bytes += size - old_size
            existing.payload = payload
            existing.size_bytes = size
            self._touch(existing)
            return existing

        entry = Entry(key, payload, size)
        entry._tree = self
        entry._node = node = self._make_node(key)
        node.entry = entry
        self._entries[key] = entry
        self._used += size
        self._unpinned_bytes += size
        self._touch(entry)
        return entry

    def match(self, tokens: Sequence[int]) -> Match:
        """Longest cached prefix of ``tokens`` and the entry to restore it from (marked used)."""
        return self.match_key(as_tokens(tokens))

    # The ``*_key`` methods take a key already in the tree's form: a tuple of ints, such
    # as an entry's ``tokens``, a slice of them, or ``as_tokens`` of a caller's tokens.
    # They skip the conversion and check of every element, which a caller making several
    # calls per prompt (SegmentTree: about a dozen per saved prompt) would pay each time.

    def match_key(self, query: tuple[int, ...]) -> Match:
        """``match`` of a key already in the tree's form."""
        node = self._root
        depth = 0
        end = len(query)
        answer_node = node
        while depth < end:
            child = node.children.get(query[depth])
            if child is None:
                break
            matched = _common_prefix(child.key, query, depth)
            depth += matched
            answer_node = child
            if matched < len(child.key):
                break  # the query ends or diverges inside this edge
            node = child
        entry = answer_node.best if depth else None
        if entry is None:
            return Match(0, None)
        self._touch(entry)
        return Match(depth, entry)

    def longest_prefix_entry(self, tokens: Sequence[int]) -> Entry | None:
        """The longest stored entry whose tokens are a prefix of ``tokens`` (``tokens``
        itself included), or None. Does not count as a use. O(L) like ``match``."""
        return self.longest_prefix_entry_key(as_tokens(tokens))

    def longest_prefix_entry_key(self, query: tuple[int, ...]) -> Entry | None:
        """``longest_prefix_entry`` of a key already in the tree's form."""
        node = self._root
        depth = 0
        found: Entry | None = None
        while depth < len(query):
            child = node.children.get(query[depth])
            if child is None or _common_prefix(child.key, query, depth) < len(child.key):
                break  # only whole edges end at an entry
            depth += len(child.key)
            node = child
            if node.entry is not None:
                found = node.entry
        return found

    def get(self, tokens: Sequence[int]) -> Entry | None:
        """The entry for exactly ``tokens``, or None. Does not count as a use."""
        return self._entries.get(as_tokens(tokens))

    def get_key(self, key: tuple[int, ...]) -> Entry | None:
        """``get`` of a key already in the tree's form."""
        return self._entries.get(key)

    def remove(self, tokens: Sequence[int]) -> Entry | None:
        """Remove the entry for exactly ``tokens`` (calling ``on_evict``); None if absent."""
        self._check_not_in_callback("remove")
        entry = self._entries.get(as_tokens(tokens))
        if entry is None:
            return None
        if entry.pins:
            raise EntryPinnedError(
                f"cannot remove an entry of {len(entry.tokens)} tokens: pinned {entry.pins} time(s)"
            )
        self._detach(entry)
        self._notify(entry)
        return entry

    def pin(self, entry: Entry) -> None:
        """Take a reference on ``entry``: it will not be evicted or removed until unpinned."""
        self._check_not_in_callback("pin")
        self._check_owned(entry, "pin")
        self._pin_internal(entry)

    def unpin(self, entry: Entry) -> None:
        """Drop one reference taken with ``pin``."""
        self._check_owned(entry, "unpin")
        if entry.pins == 0:
            raise NotPinnedError(
                f"unpin of an entry of {len(entry.tokens)} tokens that is not pinned"
            )
        self._unpin_internal(entry)

    @contextmanager
    def pinned(self, entry: Entry) -> Iterator[Entry]:
        """``with tree.pinned(entry) as e:`` pins for the duration of the block."""
        self.pin(entry)
        try:
            yield entry
        finally:
            self.unpin(entry)

    def entries(self) -> Iterator[Entry]:
        """Every cached prefix, in insertion order; a snapshot, so the tree may change meanwhile."""
        return iter(list(self._entries.values()))

    def evict(self, n_bytes: int) -> int:
        """Evict unpinned entries in eviction order until at least ``n_bytes`` are freed or
        nothing evictable is left; returns the bytes freed (which may exceed ``n_bytes``, or
        fall short of it when the rest is pinned)."""
        self._check_not_in_callback("evict")
        wanted = _as_byte_count(n_bytes, "n_bytes")
        freed = 0
        while freed < wanted:
            victim = self._pop_lru()
            if victim is None:
                break
            freed += victim.size_bytes
            self._detach(victim)
            self._notify(victim)
        return freed

    # ------------------------------------------------------------------ internals

    def _check_not_in_callback(self, what: str) -> None:
        if self._in_callback:
            raise ReentrancyError(f"on_evict callback must not call {what}() on the tree")

    def _check_owned(self, entry: Entry, what: str) -> None:
        if not isinstance(entry, Entry):
            raise UnknownEntryError(f"{what}() needs an Entry, got {type(entry).__name__}")
        if entry._tree is not self:
            state = "was evicted or removed" if entry._tree is None else "belongs to another tree"
            raise UnknownEntryError(f"{what}() of an entry that {state}")

    def _pin_internal(self, entry: Entry) -> None:
        if entry.pins == 0:
            self._unpinned_bytes -= entry.size_bytes
        entry.pins += 1

    def _unpin_internal(self, entry: Entry) -> None:
        entry.pins -= 1
        if entry.pins == 0:
            self._unpinned_bytes += entry.size_bytes
            self._push(entry)

    def _push(self, entry: Entry) -> None:
        heap = self._heap
        if len(heap) > 2 * len(self._entries) + 32:
            # Too many stale items: rebuild from the live unpinned entries.
            heap[:] = [
                (eviction_rank(e), next(self._push_seq), e.last_used, e)
                for e in self._entries.values()
                if e.pins == 0 and e is not entry
            ]
            heapq.heapify(heap)
        heapq.heappush(heap, (eviction_rank(entry), next(self._push_seq), entry.last_used, entry))

    def _pop_lru(self) -> Entry | None:
        """Take the unpinned entry that goes first (:func:`eviction_rank`) off the heap (it
        stays in the tree)."""
        heap = self._heap
        while heap:
            _, _, last_used, entry = heapq.heappop(heap)
            if entry._tree is self and entry.pins == 0 and entry.last_used == last_used:
                return entry
        return None

    def _evict_down_to(self, target_used: int) -> None:
        # Callers have checked that enough unpinned bytes exist.
        while self._used > target_used:
            victim = self._pop_lru()
            if victim is None:  # pragma: no cover - guarded by the callers' checks
                raise AssertionError("radix tree eviction ran out of unpinned entries")
            self._detach(victim)
            self._notify(victim)

    def _notify(self, entry: Entry) -> None:
        if self._on_evict is None:
            return
        self._in_callback = True
        try:
            self._on_evict(entry)
        finally:
            self._in_callback = False

    def _touch(self, entry: Entry) -> None:
        """Mark ``entry`` most recently used and refresh ``best`` on its ancestors."""
        self._clock += 1
        entry.prev_used = entry.last_used
        entry.last_used = self._clock
        entry.uses += 1
        if entry.pins == 0:
            self._push(entry)
        # ``entry`` is now the newest, so it is ``best`` of every ancestor whose shortest entry
        # is not shorter than it. Ancestors' shortest lengths only shrink going up: stop at
        # the first one with a strictly shorter entry.
        length = len(entry.tokens)
        node = entry._node
        while node is not None:
            best = node.best
            if best is not None and len(best.tokens) < length:
                break
            node.best = entry
            node = node.parent

    def _make_node(self, key: tuple[int, ...]) -> _Node:
        """The node at which ``key`` ends, splitting an edge or adding a leaf as needed."""
        node = self._root
        depth = 0
        end = len(key)
        while depth < end:
            child = node.children.get(key[depth])
            if child is None:
                leaf = _Node(key[depth:], node)
                node.children[key[depth]] = leaf
                return leaf
            matched = _common_prefix(child.key, key, depth)
            if matched < len(child.key):
                child = self._split(child, matched)
            depth += matched
            node = child
        return node

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut ``child``'s edge after ``at`` tokens; returns the new middle node."""
        parent = child.parent
        assert parent is not None and 0 < at < len(child.key)
        middle = _Node(child.key[:at], parent)
        middle.best = child.best  # same entries below it
        parent.children[middle.key[0]] = middle
        child.key = child.key[at:]
        child.parent = middle
        middle.children[child.key[0]] = child
        return middle

    def _merge_into_child(self, node: _Node) -> None:
        """Replace payload-less ``node`` that has one child by that child (longer edge)."""
        (child,) = node.children.values()
        parent = node.parent
        assert parent is not None and node.entry is None
        child.key = node.key + child.key
        child.parent = parent
        parent.children[child.key[0]] = child
        node.parent = None
        node.children = {}

    def _detach(self, entry: Entry) -> None:
        """Take ``entry`` out of the tree, keeping the structural and ``best`` invariants."""
        node = entry._node
        assert node is not None and node.entry is entry
        del self._entries[entry.tokens]
        self._used -= entry.size_bytes
        if entry.pins == 0:
            self._unpinned_bytes -= entry.size_bytes
        entry._tree = None
        entry._node = None
        node.entry = None

        parent = node.parent
        assert parent is not None
        if not node.children:
            del parent.children[node.key[0]]
            node.parent = None
            if parent is not self._root and parent.entry is None and len(parent.children) == 1:
                start = parent.parent
                self._merge_into_child(parent)
            else:
                start = parent
        elif len(node.children) == 1:
            self._merge_into_child(node)
            start = parent
        else:
            start = node
        # The ancestors whose ``best`` was ``entry`` form one chain up from ``start``; every
        # node below it no longer contains ``entry``, so their ``best`` is already right.
        while start is not None and start.best is entry:
            start.best = self._best_of(start)
            start = start.parent

    @staticmethod
    def _best_of(node: _Node) -> Entry | None:
        if node.entry is not None:
            return node.entry  # shorter than anything below it
        best: Entry | None = None
        for child in node.children.values():
            candidate = child.best
            if candidate is not None and _better(candidate, best):
                best = candidate
        return best

    def _check_invariants(self) -> None:
        """Verify every structural invariant (for tests; O(total tokens))."""
        assert self._used == sum(e.size_bytes for e in self._entries.values())
        assert self._unpinned_bytes == sum(
            e.size_bytes for e in self._entries.values() if e.pins == 0
        )
        assert self._used <= self._capacity
        seen: list[Entry] = []

        def walk(node: _Node, prefix: tuple[int, ...]) -> Entry | None:
            best: Entry | None = None
            if node.entry is not None:
                entry = node.entry
                assert entry.tokens == prefix and entry._node is node and entry._tree is self
                assert self._entries[prefix] is entry
                seen.append(entry)
                best = entry
            if node is not self._root:
                assert node.key, "non-root node with an empty edge"
                assert node.entry is not None or len(node.children) >= 2, "garbage node"
            for first, child in node.children.items():
                assert child.parent is node and child.key[0] == first
                sub = walk(child, prefix + child.key)
                assert sub is not None
                if node.entry is None and _better(sub, best):
                    best = sub
            assert node.best is best, f"stale best at {prefix!r}"
            return best

        walk(self._root, ())
        assert len(seen) == len(self._entries)
        live = {id(e) for e in self._entries.values() if e.pins == 0}
        in_heap = {
            id(e)
            for _, _, lu, e in self._heap
            if e._tree is self and e.pins == 0 and e.last_used == lu
        }
        assert live == in_heap, "an unpinned entry is missing from the eviction heap"
