"""Prefix-shared KV accounting (pure): what a cache of prompt states costs when a stored
prefix is kept once and each extension stores only its own tokens.

The KV store (``inference/kvstore.py``) charges a RAM entry :func:`ram_entry_bytes`: its
payload plus :data:`RAM_TOKEN_OVERHEAD` bytes per key token (the token ids of the index).
The payload of a *segment* holds only ``tokens[base:]`` of its prefix, on top of the stored
state of ``tokens[:base]`` (its parent), which it pins (eviction takes segments before
their parent). :class:`SegmentTree` applies the store's and the engine's rules for saving a
prompt (``Engine._save_snapshots`` with one snapshot point, ``KVStore.put`` /
``parent_length`` / ``branch_point`` / ``rebase``) to one :class:`~.radix.RadixTree` with
a payload of ``bytes_per_token`` per own token, so a caller without a model (the
simulator) keeps the same byte budget the store keeps. The differential test
``tests/inference/core/test_segments.py`` drives the real ``KVStore`` and this tree
through the same prompts and requires the same entries and bytes.

Keys: the store prepends a namespace pseudo-token to every key; so does this tree (one
namespace, pseudo-token -1), so the byte figures (``key_tokens = len(tokens) + 1`` in
:func:`ram_entry_bytes`) and the eviction order (LRU-2) are the store's: a lookup that matches no real
token still marks an entry used, in both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .radix import Entry, Match, RadixTree, as_tokens

__all__ = ["RAM_TOKEN_OVERHEAD", "Segment", "SegmentTree", "branch_point", "branch_point_of",
           "ram_entry_bytes"]

RAM_TOKEN_OVERHEAD = 4  # bytes per key token a RAM entry is charged besides its payload
_RECENT_KEYS = 256  # SegmentTree._key: prompts whose keys are kept (each a prompt's size)
# Shared by every SegmentTree of the process: a key is a pure function of the (immutable)
# tuple, so a prompt that reaches several trees (the simulator's nodes) is converted once.
_recent_keys: dict[int, tuple[tuple, tuple[int, ...]]] = {}


def ram_entry_bytes(payload_bytes: int, key_tokens: int) -> int:
    """What a RAM entry costs the store's budget: payload + 4 bytes per key token."""
    return payload_bytes + RAM_TOKEN_OVERHEAD * key_tokens


class Segment:
    """Payload of a :class:`SegmentTree` entry: where its own tokens start, the keys of
    the segments based on it, and the caller's value."""

    __slots__ = ("base", "children", "value")

    def __init__(self, base: int, value: object) -> None:
        self.base = base
        self.children: set[tuple[int, ...]] = set()
        self.value = value


class SegmentTree:
    """A one-tier prefix-shared cache of prompt states (see the module docstring).

    ``on_store(tokens, value)`` runs for every state a :meth:`save` stores, and
    ``on_evict(tokens, value)`` for every state that leaves the tree. ``min_share``: the
    engine's ``min_snapshot_tokens`` (a branch point less than that past the parent is
    not stored on its own)."""

    NS_TOKEN = -1

    def __init__(self, capacity_bytes: int, bytes_per_token: int, *, min_share: int = 16,
                 on_evict: Callable[[tuple[int, ...], object], None] | None = None,
                 on_store: Callable[[tuple[int, ...], object], None] | None = None) -> None:
        self.bytes_per_token = bytes_per_token
        self.min_share = min_share
        self._on_evict = on_evict
        self._on_store = on_store
        self.tree = RadixTree(capacity_bytes, on_evict=self._evicted)

    def _key(self, tokens: Sequence[int]) -> tuple[int, ...]:
        """The tree's key of ``tokens`` (checked here, once per public call: everything
        below works on keys with the tree's ``*_key`` methods). A caller asks about one
        prompt several times in a row (its lookup, then its match when it starts), and a
        simulated prompt reaches several nodes' trees, so the keys of the last few tuples
        are kept, shared by all trees: the same tuple object (immutable) has the same key,
        and converting a long prompt is the costly part."""
        tuple_in = type(tokens) is tuple
        if tuple_in:
            known = _recent_keys.get(id(tokens))
            if known is not None and known[0] is tokens:
                return known[1]
        key = (self.NS_TOKEN, *as_tokens(tokens))
        if tuple_in:
            recent = _recent_keys
            if len(recent) >= _RECENT_KEYS:
                # clear, not evict the oldest: the node's engine thread and its event loop
                # both ask trees, and clear() cannot race another thread's eviction
                recent.clear()
            recent[id(tokens)] = (tokens, key)  # holds ``tokens``: its id stays its own
        return key

    # --- reads -----------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return self.tree.used_bytes

    def lookup_length(self, tokens: Sequence[int]) -> int:
        """``KVStore.lookup_length``: tokens of ``tokens`` cached (marks the match used)."""
        return max(0, self.tree.match_key(self._key(tokens)).length - 1)

    def match(self, tokens: Sequence[int]) -> int:
        """``KVStore.acquire`` (a lease, released at once): the cached length; a hit marks
        the entry used, then its chain's parents, root first."""
        return self._match(self._key(tokens))

    def _match(self, key: tuple[int, ...]) -> int:
        m = self.tree.match_key(key)
        if m.length - 1 >= 1:
            for parent in self._parents(m.entry):
                self.tree.match_key(parent.tokens)
        return max(0, m.length - 1)

    def get(self, tokens: Sequence[int]) -> Entry | None:
        return self.tree.get_key(self._key(tokens))

    def covered(self, tokens: Sequence[int]) -> bool:
        """``KVStore.covered``: some entry starts with all of ``tokens`` (may count as a use)."""
        return self._covered(self._key(tokens))

    def _covered(self, key: tuple[int, ...]) -> bool:
        if self.tree.get_key(key) is not None:
            return True
        return self.tree.match_key(key).length == len(key)

    def _parents(self, entry: Entry) -> list[Entry]:
        chain: list[Entry] = []
        while entry.payload.base:
            entry = self.tree.get_key(entry.tokens[: entry.payload.base + 1])
            chain.append(entry)
        chain.reverse()
        return chain

    # --- saving a prompt (Engine._save_snapshots, one point) -----------------------------

    def save(self, tokens: Sequence[int], value_of: Callable[[int], object]) -> int:
        """Store the state of ``tokens`` as the engine does; ``value_of(n)`` gives the
        value of a new entry for ``tokens[:n]`` (``on_store`` is told of each as it is
        stored, before any later eviction). Returns how many states were stored (0 when
        some entry covers ``tokens``)."""
        key = self._key(tokens)
        n_tokens = len(key) - 1
        if not n_tokens or self._covered(key):
            return 0
        saved = 0
        base = self._parent_length(key)
        split, other, other_base = branch_point_of(self.tree.match_key(key), key)
        rebase = None
        if other is not None and split - base >= self.min_share and other_base <= base:
            if self._put(key[: split + 1], base, value_of(split)):
                saved += 1
                if other_base == base:
                    rebase = ((self.NS_TOKEN, *other), split)
                base = split
        if self._put(key, base, value_of(n_tokens)):
            saved += 1
        if rebase is not None:
            self._rebase(*rebase)
        return saved

    def _parent_length(self, key: tuple[int, ...]) -> int:
        entry = self.tree.longest_prefix_entry_key(key[:-1])
        return len(entry.tokens) - 1 if entry is not None else 0

    def _size(self, n_tokens: int, base: int) -> int:
        return ram_entry_bytes((n_tokens - base) * self.bytes_per_token, n_tokens + 1)

    def _put(self, key: tuple[int, ...], base: int, value: object) -> bool:
        """``KVStore.put`` in one tier: replace an unpinned old state, link on the parent."""
        old = self.tree.get_key(key)
        if old is not None:
            if old.pins:
                return False
            self.tree.remove(key)
        parent = None
        if base:
            parent = self.tree.get_key(key[: base + 1])
            if parent is None:
                return False
            self.tree.pin(parent)
        entry = self.tree.insert_key(key, Segment(base, value), self._size(len(key) - 1, base))
        if parent is not None:
            if entry is None:
                self.tree.unpin(parent)
            else:
                parent.payload.children.add(key)
        if entry is not None and self._on_store is not None:
            self._on_store(key[1:], value)
        return entry is not None

    def _rebase(self, key: tuple[int, ...], new_base: int) -> bool:
        """``KVStore.rebase``: the state of ``key`` keeps only its tokens past
        ``new_base`` (the engine leases the state first: a use)."""
        self._match(key)
        entry, parent = self.tree.get_key(key), self.tree.get_key(key[: new_base + 1])
        if entry is None or parent is None or not 0 <= entry.payload.base < new_base:
            return False
        if not self._under(parent, entry.payload.base):
            return False
        item = entry.payload
        self.tree.pin(parent)
        parent.payload.children.add(key)
        self._unlink(key, item)
        item.base = new_base
        self.tree.insert_key(key, item, self._size(len(key) - 1, new_base))  # smaller
        return True

    def _under(self, entry: Entry, base: int) -> bool:
        """Whether ``entry``'s chain reaches down to exactly ``base`` tokens."""
        while len(entry.tokens) - 1 > base:
            if entry.payload.base < base:
                return False
            if entry.payload.base == base:
                return True
            entry = self.tree.get_key(entry.tokens[: entry.payload.base + 1])
        return len(entry.tokens) - 1 == base

    def _unlink(self, key: tuple[int, ...], item: Segment) -> None:
        if item.base:
            parent = self.tree.get_key(key[: item.base + 1])
            if parent is not None and key in parent.payload.children:
                parent.payload.children.discard(key)
                self.tree.unpin(parent)

    def _evicted(self, entry: Entry) -> None:
        item = entry.payload
        if isinstance(item, Segment):
            self._unlink(entry.tokens, item)
            if self._on_evict is not None:
                self._on_evict(entry.tokens[1:], item.value)


def branch_point(tree, key: tuple[int, ...]) -> tuple[int, tuple[int, ...] | None, int]:
    """(L, other, other_base) for ``key`` (a namespace token, then the prompt's tokens) in a
    radix tree of stored states: the prompt shares L tokens with the stored state of
    ``other`` and diverges from it there (0 < L < both lengths); ``other_base`` is where
    that state's own segment starts. (0, None, 0) if there is no such state. One rule for
    the store (``KVStore.branch_point``) and :class:`SegmentTree`."""
    return branch_point_of(tree.match(key), key)


def branch_point_of(m: Match, key: tuple[int, ...]) -> tuple[int, tuple[int, ...] | None, int]:
    """:func:`branch_point` from the tree's ``match`` of ``key``."""
    length = m.length - 1
    if m.entry is None or length <= 0 or length >= len(key) - 1:
        return 0, None, 0
    if len(m.entry.tokens) - 1 <= length:
        return 0, None, 0
    return length, m.entry.tokens[1:], m.entry.payload.base
