"""KV store: saved per-sequence KV states of prompt prefixes, in a RAM tier and a disk tier.

What is stored. A *state* is the opaque byte string ``llama_state_seq_get_data`` returns for
one sequence holding exactly the tokens of a prefix. The store never interprets it; the
engine restores it with ``llama_state_seq_set_data`` and may truncate it to a shorter prefix.
This module imports no llama code, so its logic is unit-testable with synthetic bytes.

Index. Each tier is a :class:`~prefixmesh.inference.core.radix.RadixTree` keyed by
``(namespace pseudo-token,) + token ids``; the pseudo-token is a negative int assigned per
namespace id, so prefixes of different namespaces are disjoint by construction and a
lookup in one namespace can never return another namespace's state. Both tiers are
searched on lookup and the longer match wins (RAM on a tie).

Segments (prefix sharing). A state may hold only ``tokens[base:]`` of its prefix (a
*segment*, ``put(..., base=)``); it is usable only on top of the stored state of
``tokens[:base]``, its parent, in the same tier. A lease hands out the chain, root first
(``Lease.segments``). Each tier stays closed under parents: a segment pins its parent there
(so eviction takes segments before their parent), is stored in a tier only where its
parent is, a disk hit promotes the chain root first, and removing or losing a state (bad
file) removes the segments based on it. ``rebase`` re-bases a state onto a new, longer
parent of the same chain (a new branch point), so a prefix shared by K prompts is stored
once: bytes grow with unique tokens.

Budgets. Each tier's tree enforces its byte budget (RAM: payload bytes + 4 per token; disk:
file sizes) by evicting least-recently-used *unpinned* entries. An entry is pinned while a
:class:`Lease` on it is held (a request is restoring it). An entry evicted from RAM is
demoted to disk when it is not there already and the disk budget allows; an entry evicted
from disk has its file deleted. A prefix counts as cached while it is in either tier;
``on_change`` gets one ``add`` when a prefix becomes cached and one ``remove`` when it is
in neither tier any more. Changes are queued while the trees are being modified and
delivered after each public call returns (callbacks never run inside a tree operation).

Disk layout: ``<disk_dir>/<fingerprint hex[:32]>/<namespace id hex>/<blake2b(key) hex>.kv``,
written as a temp file (``.tmp-*.part``) in the same folder, fsynced, renamed, folder
fsynced, so a crash at any point leaves either the old file, the new file or no file, never a
partial one under a ``.kv`` name. File format (little endian)::

    magic  b"PMKV"            4
    version u16, flags u16    4
    fingerprint               32   (model + state-layout fingerprint, see engine)
    namespace id              8
    n_tokens u32              4
    payload_len u64           8
    base u32                  4    only when flags has FLAG_SEGMENT (1): tokens [base, n)
    token ids u32 * n_tokens       all tokens of the prefix (the index needs them)
    payload                   payload_len
    checksum                  32   BLAKE2b-256 over everything before it

Write-behind. A ``put`` stores the state in RAM and, at once, reserves its place in the disk
index and queues the bytes for a writer thread (one per store) that checksums, writes and
fsyncs them, so a newly cached prefix is on disk within ``write_delay_s`` of its ``put``
without the caller waiting for the disk. The bound is kept by back-pressure: a ``put`` that
finds the oldest queued state older than ``write_delay_s`` (or more than
``max_pending_bytes`` queued) waits for the writer. A crash (``kill -9``) loses at most the
states put in the last ``write_delay_s``; what was on disk stays valid. A queued state is
served from its bytes in memory until it is written, and an entry evicted before its write
is simply not written (the writer renames under the store lock and checks first). An entry
leaving RAM needs no write when its disk copy exists or is queued (demotion is then free).

Start-up reads only the headers and token ids (bounded; no checksum): the index is ready
without reading the payloads. A file that is truncated (its size disagrees with its header),
carries another fingerprint or namespace than its folder says, or exceeds the limits is
logged, counted and deleted at start; ``verify_on_start=True`` also checks every checksum
then (slow on a big cache). Every read of a file verifies its checksum, so a damaged payload
is found when it is first loaded: the file is removed with a log line and the lookup is
retried (a miss, never an error). Disk recency survives restarts through file mtimes
(touched on every disk hit). ``close`` stops the writer after the queue drains, within
its timeout; what is still queued then is dropped (it is only a cache).

Thread safety: every public method takes the store's re-entrant lock, so lookups (routing)
and lease releases may come from any thread; ``on_change`` runs with the lock held. The
writer thread takes the same lock only to pick a job and to rename or discard its file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import wraps
from pathlib import Path

from .core.radix import Entry, RadixTree
from .core.segments import (  # the RAM accounting and branch rule, shared with the simulator
    branch_point,
    ram_entry_bytes,
)

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "FINGERPRINT_BYTES",
    "MAX_STATE_TOKENS",
    "StoreChange",
    "Lease",
    "StoreStats",
    "KVStoreError",
    "KVStore",
    "encode_state_file",
    "decode_state_file",
    "read_state_file",
    "CorruptStateFile",
]

log = logging.getLogger(__name__)

MAGIC = b"PMKV"
FORMAT_VERSION = 1
FINGERPRINT_BYTES = 32
NS_ID_BYTES = 8
CHECKSUM_BYTES = 32
MAX_STATE_TOKENS = 1 << 20
_HEADER = struct.Struct("<4sHH32s8sIQ")
FLAG_SEGMENT = 1  # a u32 ``base`` follows the header: the state holds tokens [base, n_tokens)
_BASE = struct.Struct("<I")


class KVStoreError(Exception):
    """Base class of KV store errors."""


class CorruptStateFile(KVStoreError):
    """A state file is truncated, fails its checksum, or does not belong here."""


@dataclass(frozen=True)
class StoreChange:
    kind: str  # "add" | "remove"
    ns_id: bytes
    tokens: tuple[int, ...]


@dataclass
class StoreStats:
    ram_entries: int = 0
    ram_bytes: int = 0
    ram_budget_bytes: int = 0
    disk_entries: int = 0
    disk_bytes: int = 0
    disk_budget_bytes: int = 0
    hits_ram: int = 0
    hits_disk: int = 0
    misses: int = 0
    puts: int = 0
    demotions: int = 0
    promotions: int = 0
    disk_writes: int = 0
    disk_write_errors: int = 0
    writes_skipped: int = 0  # queued states evicted or removed before their write
    write_waits: int = 0  # puts that waited for the writer (back-pressure)
    pending_writes: int = 0
    pending_bytes: int = 0
    corrupt_files_removed: int = 0
    foreign_files_removed: int = 0


def _checksum(*parts: bytes | memoryview) -> bytes:
    h = hashlib.blake2b(digest_size=CHECKSUM_BYTES)
    for p in parts:
        h.update(p)
    return h.digest()


def _state_file_head(
    fingerprint: bytes, ns_id: bytes, tokens: Sequence[int], payload_len: int, base: int = 0
) -> bytes:
    if len(fingerprint) != FINGERPRINT_BYTES or len(ns_id) != NS_ID_BYTES:
        raise ValueError("bad fingerprint or namespace id length")
    if not 0 <= base < max(1, len(tokens)):
        raise ValueError("a segment's base must lie inside its tokens")
    flags = FLAG_SEGMENT if base else 0
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, flags, fingerprint, ns_id, len(tokens), payload_len)
    if base:
        head += _BASE.pack(base)
    return head + struct.pack(f"<{len(tokens)}I", *tokens)


def _as_bytes_view(data) -> memoryview:
    """A flat byte view of a state (bytes, bytearray or a ctypes uint8 array)."""
    return memoryview(data).cast("B")


def encode_state_file(
    fingerprint: bytes, ns_id: bytes, tokens: Sequence[int], payload: bytes, base: int = 0
) -> tuple[bytes, bytes]:
    """Header+tokens and the trailing checksum of a state file (payload goes between them);
    ``base`` > 0 marks a segment holding only tokens[base:] (its parent holds the rest)."""
    view = _as_bytes_view(payload)
    head = _state_file_head(fingerprint, ns_id, tokens, len(view), base)
    return head, _checksum(head, view)


def _parse_header(f, file_size: int, max_payload: int):
    """(head bytes, fingerprint, ns_id, tokens, base, payload_len) of an open state file."""
    head = f.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise CorruptStateFile("shorter than the header")
    magic, version, flags, fp, ns_id, n_tokens, payload_len = _HEADER.unpack_from(head)
    if magic != MAGIC:
        raise CorruptStateFile(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise CorruptStateFile(f"unknown format version {version}")
    if flags & ~FLAG_SEGMENT:
        raise CorruptStateFile(f"unknown flags {flags:#x}")
    if not 0 < n_tokens <= MAX_STATE_TOKENS:
        raise CorruptStateFile(f"token count {n_tokens} out of range")
    if payload_len > max_payload:
        raise CorruptStateFile(f"payload of {payload_len} bytes over the limit {max_payload}")
    base = 0
    if flags & FLAG_SEGMENT:
        raw = f.read(_BASE.size)
        if len(raw) != _BASE.size:
            raise CorruptStateFile("truncated segment base")
        head += raw
        (base,) = _BASE.unpack(raw)
        if not 0 < base < n_tokens:
            raise CorruptStateFile(f"segment base {base} outside its {n_tokens} tokens")
    expected = len(head) + 4 * n_tokens + payload_len + CHECKSUM_BYTES
    if file_size != expected:
        raise CorruptStateFile(f"file is {file_size} bytes, header says {expected}")
    tok_bytes = f.read(4 * n_tokens)
    if len(tok_bytes) != 4 * n_tokens:
        raise CorruptStateFile("truncated token ids")
    tokens = struct.unpack(f"<{n_tokens}I", tok_bytes)
    return head + tok_bytes, fp, ns_id, tokens, base, payload_len


def read_state_file(path: Path, *, max_payload: int, verify: bool = True):
    """Read ``path``: (fingerprint, ns_id, tokens, base, payload or None when ``verify`` is
    False). Raises :class:`CorruptStateFile` for anything malformed, OSError for I/O."""
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        head, fp, ns_id, tokens, base, payload_len = _parse_header(f, file_size, max_payload)
        if not verify:
            return fp, ns_id, tokens, base, None
        payload = bytearray(payload_len)  # bytearray: the engine restores from it in place
        got = f.readinto(payload)
        trailer = f.read(CHECKSUM_BYTES + 1)
    if got != payload_len or len(trailer) != CHECKSUM_BYTES:
        raise CorruptStateFile("truncated payload")
    if _checksum(head, payload) != trailer:
        raise CorruptStateFile("checksum mismatch")
    return fp, ns_id, tokens, base, payload


def decode_state_file(
    path: Path, *, max_payload: int, verify: bool = True
) -> tuple[bytes, bytes, tuple[int, ...], bytearray | None]:
    """Read ``path``: (fingerprint, ns_id, tokens, payload or None when ``verify`` is False)
    (:func:`read_state_file` without the segment base)."""
    fp, ns_id, tokens, _base, payload = read_state_file(
        path, max_payload=max_payload, verify=verify)
    return fp, ns_id, tokens, payload


def _locked(method):
    @wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


class _RamItem:
    # base: first token the state holds (0: a whole prefix; > 0: a segment whose parent is
    # the entry of tokens[:base] in the same tier); children: keys of segments based on it
    __slots__ = ("ns_id", "data", "base", "children")

    def __init__(self, ns_id: bytes, data, base: int = 0) -> None:
        self.ns_id = ns_id
        self.data = data
        self.base = base
        self.children: set[tuple[int, ...]] = set()


class _DiskItem:
    """A disk-tier entry. ``data`` is not None while the state is queued for the writer
    (it is served from memory until then); ``dropped`` marks an entry that left the index
    before its write finished (the writer then discards its temp file)."""

    __slots__ = ("ns_id", "path", "data", "size", "queued_at", "dropped", "base", "children",
                 "gen", "on_disk")

    def __init__(self, ns_id: bytes, path: Path, data=None, size: int = 0,
                 base: int = 0) -> None:
        self.ns_id = ns_id
        self.path = path
        self.data = data
        self.size = size
        self.queued_at = 0.0
        self.dropped = False
        self.base = base
        self.children: set[tuple[int, ...]] = set()
        self.gen = 0  # bumped when a rebase queues a new version of the file
        self.on_disk = data is None  # a file exists under ``path``


class Lease:
    """A restorable state, pinned in the store until :meth:`release` (or ``with``)."""

    def __init__(self, store: KVStore, tier: str, entry: Entry, length: int,
                 segments: list[tuple[int, object]]):
        self.tier = tier  # "ram" | "disk" (where it was found)
        self.length = length  # tokens of the query this state serves
        self.tokens = entry.tokens[1:]  # the tokens the state holds
        self.entry_tokens = len(self.tokens)  # >= length
        # (base, state) root first: restore each in turn; state i holds tokens
        # [base_i, base_{i+1}) (the last one up to entry_tokens)
        self.segments = segments
        self.data = segments[-1][1]  # the entry's own state (the whole prefix when base 0)
        self._store = store
        self._entry: Entry | None = entry

    def release(self) -> None:
        if self._entry is not None:
            entry, self._entry = self._entry, None
            self._store._release(entry)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class KVStore:
    def __init__(
        self,
        *,
        fingerprint: bytes,
        ram_budget_bytes: int,
        disk_budget_bytes: int = 0,
        disk_dir: str | os.PathLike[str] | None = None,
        on_change: Callable[[StoreChange], None] | None = None,
        verify_on_start: bool = False,
        fsync: bool = True,
        write_delay_s: float = 2.0,
        max_pending_bytes: int = 256 << 20,
    ) -> None:
        if len(fingerprint) != FINGERPRINT_BYTES:
            raise ValueError(f"fingerprint must be {FINGERPRINT_BYTES} bytes")
        if not write_delay_s > 0 or max_pending_bytes < 0:
            raise ValueError("write_delay_s must be > 0 and max_pending_bytes >= 0")
        self.fingerprint = fingerprint
        self.write_delay_s = float(write_delay_s)
        self.max_pending_bytes = int(max_pending_bytes)
        self._lock = threading.RLock()
        self._writer_cv = threading.Condition(self._lock)
        self._queue: deque[tuple[tuple[int, ...], _DiskItem, int]] = deque()
        self._writing = False
        self._closing = False
        self._writer: threading.Thread | None = None
        self._on_change = on_change
        self._fsync = fsync
        self._pending: list[StoreChange] = []
        self._ns_token: dict[bytes, int] = {}
        self._ram = RadixTree(ram_budget_bytes, on_evict=self._ram_evicted)
        disk_budget = disk_budget_bytes if disk_dir is not None else 0
        self._disk = RadixTree(disk_budget, on_evict=self._disk_evicted)
        self._dropping: set[tuple[int, ...]] = set()  # keys removed on purpose: no demotion
        self._replacing: set[tuple[int, ...]] = set()  # disk copies being replaced: no event
        self.stats = StoreStats(ram_budget_bytes=ram_budget_bytes, disk_budget_bytes=disk_budget)
        self.model_dir: Path | None = None
        if disk_dir is not None and disk_budget > 0:
            self.model_dir = Path(disk_dir) / fingerprint.hex()[:32]
            self.model_dir.mkdir(parents=True, exist_ok=True)
            self._rebuild(verify_on_start)
            self._writer = threading.Thread(
                target=self._writer_loop, name="prefixmesh-kv-writer", daemon=True
            )
            self._writer.start()
        self._flush_changes()

    # ------------------------------------------------------------------ helpers

    def _key(self, ns_id: bytes, tokens: Sequence[int]) -> tuple[int, ...]:
        if len(ns_id) != NS_ID_BYTES:
            raise ValueError(f"namespace id must be {NS_ID_BYTES} bytes")
        pseudo = self._ns_token.get(ns_id)
        if pseudo is None:
            pseudo = self._ns_token[ns_id] = -(len(self._ns_token) + 1)
        return (pseudo, *tokens)

    def _emit(self, kind: str, ns_id: bytes, key: tuple[int, ...]) -> None:
        self._pending.append(StoreChange(kind, ns_id, tuple(key[1:])))

    def _flush_changes(self) -> None:
        while self._pending:
            change = self._pending.pop(0)
            if self._on_change is not None:
                try:
                    self._on_change(change)
                except Exception:  # a listener's bug must not corrupt the store
                    log.exception("KV store change listener failed")

    def _update_sizes(self) -> None:
        s = self.stats
        s.ram_entries, s.ram_bytes = len(self._ram), self._ram.used_bytes
        s.disk_entries, s.disk_bytes = len(self._disk), self._disk.used_bytes
        s.pending_writes = len(self._queue)
        s.pending_bytes = sum(item.size for _, item, _ in self._queue)
        s.ram_budget_bytes, s.disk_budget_bytes = (
            self._ram.capacity_bytes,
            self._disk.capacity_bytes,
        )

    def _path_for(self, ns_id: bytes, key: tuple[int, ...]) -> Path:
        assert self.model_dir is not None
        name = hashlib.blake2b(
            ns_id + struct.pack(f"<{len(key) - 1}I", *key[1:]), digest_size=16
        ).hexdigest()
        return self.model_dir / ns_id.hex() / f"{name}.kv"

    # ------------------------------------------------------------------ tree callbacks

    def _link(self, tree: RadixTree, key: tuple[int, ...], item, size: int) -> Entry | None:
        """Insert a state into ``tree``; a segment pins its parent there (so a parent leaves
        a tier only after its children); None if it does not fit or its parent is absent."""
        parent = None
        if item.base:
            parent = tree.get(key[: item.base + 1])
            if parent is None:
                return None
            tree.pin(parent)
        entry = tree.insert(key, item, size)
        if parent is not None:
            if entry is None:
                tree.unpin(parent)
            else:
                parent.payload.children.add(key)
        return entry

    @staticmethod
    def _unlink(tree: RadixTree, key: tuple[int, ...], item) -> None:
        """A state left ``tree``: release its parent's pin (called from on_evict)."""
        if item.base:
            parent = tree.get(key[: item.base + 1])
            if parent is not None and key in parent.payload.children:
                parent.payload.children.discard(key)
                tree.unpin(parent)

    def _chain(self, tree: RadixTree, entry: Entry) -> list[Entry]:
        """``entry`` and its ancestors, root first; the ancestors count as used."""
        chain = [entry]
        while chain[-1].payload.base:
            tail = chain[-1]
            chain.append(tree.get(tail.tokens[: tail.payload.base + 1]))
        chain.reverse()
        for ancestor in chain[:-1]:
            tree.match(ancestor.tokens)
        return chain

    def _subtree(self, tree: RadixTree, key: tuple[int, ...]) -> list[Entry]:
        """The entry of ``key`` and every segment based on it (transitively), leaves first."""
        out: list[Entry] = []
        entry = tree.get(key)
        if entry is not None:
            for child in list(entry.payload.children):
                out.extend(self._subtree(tree, child))
            out.append(entry)
        return out

    def _drop_subtree(self, tree: RadixTree, key: tuple[int, ...]) -> bool:
        """Remove ``key`` and its descendants from ``tree`` (no demotion); False if some
        entry of them is leased (then nothing is removed)."""
        entries = self._subtree(tree, key)
        if any(e.pins > len(e.payload.children) for e in entries):
            return False
        for e in entries:
            self._dropping.add(e.tokens)
        try:
            for e in entries:
                tree.remove(e.tokens)
        finally:
            for e in entries:
                self._dropping.discard(e.tokens)
        return True

    def _ram_evicted(self, entry: Entry) -> None:
        item: _RamItem = entry.payload
        key = entry.tokens
        self._unlink(self._ram, key, item)
        if key in self._replacing:
            return
        if key in self._dropping:
            if self._disk.get(key) is None:
                self._emit("remove", item.ns_id, key)
            return
        if self._disk.get(key) is not None:  # written or queued by write-behind: free
            self.stats.demotions += 1
            return
        if self._write_disk(item.ns_id, key, item.data, item.base):
            self.stats.demotions += 1
        else:
            self._emit("remove", item.ns_id, key)

    def _disk_evicted(self, entry: Entry) -> None:
        item: _DiskItem = entry.payload
        self._unlink(self._disk, entry.tokens, item)
        item.dropped = True
        if item.data is not None:  # still queued: the writer skips it
            item.data = None
            self.stats.writes_skipped += 1
        if item.on_disk:
            try:
                item.path.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("could not delete KV state file %s: %s", item.path, exc)
        if self._ram.get(entry.tokens) is None and entry.tokens not in self._replacing:
            self._emit("remove", item.ns_id, entry.tokens)

    # ------------------------------------------------------------------ disk

    @staticmethod
    def _file_size(key: tuple[int, ...], payload_len: int, base: int) -> int:
        return (_HEADER.size + (_BASE.size if base else 0) + 4 * (len(key) - 1) + payload_len
                + CHECKSUM_BYTES)

    def _write_disk(self, ns_id: bytes, key: tuple[int, ...], data, base: int = 0) -> bool:
        """Index a state in the disk tier and queue it for the writer thread; False if it
        does not fit, its parent segment is not on disk, or there is no disk tier. Caller
        holds the lock."""
        if self.model_dir is None or self._closing:
            return False
        assert self._disk.get(key) is None, "a disk entry is never replaced in place"
        size = self._file_size(key, len(_as_bytes_view(data)), base)
        item = _DiskItem(ns_id, self._path_for(ns_id, key), data, size, base)
        if self._link(self._disk, key, item, size) is None:
            return False
        self._enqueue(key, item)
        return True

    def _enqueue(self, key: tuple[int, ...], item: _DiskItem) -> None:
        item.queued_at = time.monotonic()
        self._queue.append((key, item, item.gen))
        self._writer_cv.notify_all()

    def _wait_for_writer(self) -> None:
        """Back-pressure (caller holds the lock): wait while the oldest queued state is older
        than ``write_delay_s`` or the queue holds more than ``max_pending_bytes``, so that
        the write-behind window stays bounded when the disk is slower than the puts."""
        waited = False
        while self._queue and self._writer is not None and self._writer.is_alive():
            oldest = self._queue[0][1]
            pending = sum(item.size for _, item, _ in self._queue)
            age = time.monotonic() - oldest.queued_at
            if age < self.write_delay_s and pending <= self.max_pending_bytes:
                break
            waited = True
            self._writer_cv.wait(0.05)
        if waited:
            self.stats.write_waits += 1

    def _writer_loop(self) -> None:
        cv = self._writer_cv
        while True:
            with cv:
                while not self._queue and not self._closing:
                    cv.wait()
                if not self._queue:
                    return  # closing and drained
                key, item, gen = self._queue[0]
                data = item.data
                if data is None or item.dropped or item.gen != gen:  # dropped or superseded
                    self._queue.popleft()
                    cv.notify_all()
                    continue
                base = item.base
                self._writing = True
            try:
                self._write_one(key, item, data, gen, base)
            finally:
                with cv:
                    self._writing = False
                    if self._queue and self._queue[0][1] is item:
                        self._queue.popleft()
                    self._update_sizes()
                    cv.notify_all()
                self._flush_changes_async()

    def _write_one(self, key: tuple[int, ...], item: _DiskItem, data, gen: int,
                   base: int) -> None:
        """Writer thread: temp file, fsync, then (under the lock, if the entry is still
        indexed) rename over the final name and fsync the folder."""
        path = item.path
        tmp_name = None
        try:
            view = _as_bytes_view(data)
            head = _state_file_head(self.fingerprint, item.ns_id, key[1:], len(view), base)
            checksum = _checksum(head, view)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp_name = tempfile.mkstemp(prefix=".tmp-", suffix=".part", dir=path.parent)
            with os.fdopen(fd, "wb") as f:
                f.write(head)
                f.write(view)
                f.write(checksum)
                f.flush()
                if self._fsync:
                    os.fsync(f.fileno())
            with self._lock:
                if item.dropped or item.gen != gen:  # evicted, or a newer version is queued
                    Path(tmp_name).unlink(missing_ok=True)
                    tmp_name = None
                    return
                os.replace(tmp_name, path)
                tmp_name = None
                item.data = None  # on disk now: later reads come from the file
                item.on_disk = True
                self.stats.disk_writes += 1
            if self._fsync:
                fsync_dir(path.parent)
        except OSError as exc:
            log.warning("could not write KV state file %s: %s", path, exc)
            if tmp_name is not None:
                Path(tmp_name).unlink(missing_ok=True)
            with self._lock:
                self.stats.disk_write_errors += 1
                entry = self._disk.get(key)
                if not item.dropped and entry is not None and entry.payload is item:
                    self._drop_subtree(self._disk, key)  # emits "remove" when RAM lacks it

    def _flush_changes_async(self) -> None:
        with self._lock:
            self._flush_changes()

    def _discard_file(self, path: Path, reason: str, *, foreign: bool = False) -> None:
        log.warning("removing KV state file %s: %s", path, reason)
        if foreign:
            self.stats.foreign_files_removed += 1
        else:
            self.stats.corrupt_files_removed += 1
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("could not delete %s: %s", path, exc)

    def _rebuild(self, verify: bool) -> None:
        assert self.model_dir is not None
        found: list[tuple[float, bytes, tuple[int, ...], Path, int, int]] = []
        max_payload = self._disk.capacity_bytes
        for ns_dir in sorted(self.model_dir.iterdir()):
            try:
                dir_ns = bytes.fromhex(ns_dir.name)
            except ValueError:
                dir_ns = b""
            if not ns_dir.is_dir() or len(dir_ns) != NS_ID_BYTES:
                log.warning("ignoring unexpected entry %s in the KV store", ns_dir)
                continue
            for path in sorted(ns_dir.iterdir()):
                if path.name.startswith(".tmp-"):
                    path.unlink(missing_ok=True)  # a write interrupted by a crash
                    continue
                if not path.name.endswith(".kv") or not path.is_file():
                    continue
                try:
                    st = path.stat()
                    fp, ns_id, tokens, base, _ = read_state_file(
                        path, max_payload=max_payload, verify=verify
                    )
                except CorruptStateFile as exc:
                    self._discard_file(path, str(exc))
                    continue
                except OSError as exc:
                    self._discard_file(path, f"unreadable: {exc}")
                    continue
                if fp != self.fingerprint:
                    self._discard_file(path, "state of another model or layout", foreign=True)
                    continue
                key = self._key(ns_id, tokens)
                if ns_id != dir_ns or self._path_for(ns_id, key) != path:
                    self._discard_file(path, "file name or folder does not match its header")
                    continue
                found.append((st.st_mtime, ns_id, key, path, st.st_size, base))
        # parents (shorter) before the segments based on them; then recency from mtimes
        found.sort(key=lambda f: (len(f[2]), f[0]))
        kept = []
        for f in found:
            mtime, ns_id, key, path, size, base = f
            if base and self._disk.get(key[: base + 1]) is None:
                self._discard_file(path, "segment whose parent state is missing")
                continue
            if self._link(self._disk, key, _DiskItem(ns_id, path, None, size, base),
                          size) is None:
                self._discard_file(path, "over the disk budget")
                continue
            kept.append(f)
        for f in sorted(kept, key=lambda f: f[0]):  # oldest first: newest most recently used
            if self._disk.get(f[2]) is not None:
                self._disk.match(f[2])
                self._emit("add", f[1], f[2])
        self._update_sizes()

    def _read_disk(self, entry: Entry):
        item: _DiskItem = entry.payload
        if item.data is not None:  # queued for the writer: the bytes are still in memory
            return item.data
        try:
            fp, ns_id, tokens, base, payload = read_state_file(
                item.path, max_payload=self._disk.capacity_bytes
            )
            if (fp != self.fingerprint or ns_id != item.ns_id or tokens != entry.tokens[1:]
                    or base != item.base):
                raise CorruptStateFile("header does not match the index")
        except (CorruptStateFile, OSError) as exc:
            self._discard_file(item.path, f"unloadable ({exc}); treated as a miss")
            item.on_disk = False
            self._drop_subtree(self._disk, entry.tokens)  # its segments are useless now
            return None
        try:
            os.utime(item.path)  # recency survives restarts
        except OSError:
            pass
        return payload

    # ------------------------------------------------------------------ public API

    @_locked
    def lookup_length(self, ns_id: bytes, tokens: Sequence[int]) -> tuple[int, str | None]:
        """How many tokens of ``tokens`` are cached (and where); counts as a use like ``acquire``."""
        key = self._key(ns_id, tokens)
        lr = self._ram.match(key).length - 1
        ld = self._disk.match(key).length - 1
        if max(lr, ld) <= 0:
            return 0, None
        return (lr, "ram") if lr >= ld else (ld, "disk")

    @_locked
    def acquire(self, ns_id: bytes, tokens: Sequence[int], *, min_tokens: int = 1) -> Lease | None:
        """The longest cached prefix of ``tokens`` in namespace ``ns_id``, pinned, or None.

        A disk hit is read, verified and promoted to RAM; a file that fails verification is
        removed and the RAM/disk lookup repeats (so a corrupt file costs a miss, not an error).
        """
        try:
            key = self._key(ns_id, tokens)
            while True:
                mr = self._ram.match(key)
                md = self._disk.match(key)
                lr, ld = mr.length - 1, md.length - 1
                if max(lr, ld) < min_tokens:
                    self.stats.misses += 1
                    return None
                if lr >= ld:
                    chain = self._chain(self._ram, mr.entry)
                    self._ram.pin(mr.entry)
                    self.stats.hits_ram += 1
                    segments = [(e.payload.base, e.payload.data) for e in chain]
                    return Lease(self, "ram", mr.entry, lr, segments)
                entry = md.entry
                chain = self._chain(self._disk, entry)
                datas = []
                for e in chain:
                    data = self._read_disk(e)  # None: the file was bad and is gone now
                    if data is None:
                        break
                    datas.append(data)
                if len(datas) < len(chain):
                    if entry.stored:  # a leased segment kept it: give up on this lookup
                        self.stats.misses += 1
                        return None
                    continue
                self.stats.hits_disk += 1
                segments = [(e.payload.base, d) for e, d in zip(chain, datas, strict=True)]
                # Promote the chain, root first: later hits are served from RAM; the files
                # stay as the disk copies. The disk entry is pinned so that demotions caused
                # by these inserts cannot evict it.
                self._disk.pin(entry)
                try:
                    for e, data in zip(chain, datas, strict=True):
                        if self._ram.get(e.tokens) is None:
                            size = ram_entry_bytes(len(_as_bytes_view(data)), len(e.tokens))
                            if self._link(self._ram, e.tokens,
                                          _RamItem(ns_id, data, e.payload.base), size) is None:
                                break
                            self.stats.promotions += 1
                    ram_entry = self._ram.get(entry.tokens)
                    if ram_entry is not None:
                        self._ram.pin(ram_entry)
                        return Lease(self, "disk", ram_entry, ld, segments)
                    self._disk.pin(entry)
                    return Lease(self, "disk", entry, ld, segments)
                finally:
                    self._disk.unpin(entry)
        finally:
            self._update_sizes()
            self._flush_changes()

    @_locked
    def _release(self, entry: Entry) -> None:
        if entry.stored:
            tree = self._ram if isinstance(entry.payload, _RamItem) else self._disk
            tree.unpin(entry)

    @_locked
    def contains(self, ns_id: bytes, tokens: Sequence[int]) -> str | None:
        """Tier holding exactly ``tokens`` ("ram" preferred), or None; not a use."""
        key = self._key(ns_id, tokens)
        if self._ram.get(key) is not None:
            return "ram"
        if self._disk.get(key) is not None:
            return "disk"
        return None

    @_locked
    def covered(self, ns_id: bytes, tokens: Sequence[int]) -> bool:
        """Whether some stored entry (either tier) starts with all of ``tokens``. Not a use."""
        key = self._key(ns_id, tokens)
        for tree in (self._ram, self._disk):
            if tree.get(key) is not None:
                return True
        # match() counts as a use; acceptable for the "is it worth snapshotting" question, as
        # the caller is about to use this prefix anyway.
        return any(tree.match(key).length == len(key) for tree in (self._ram, self._disk))

    @_locked
    def put(self, ns_id: bytes, tokens: Sequence[int], data, *, base: int = 0) -> bool:
        """Store the state for exactly ``tokens``; False if it fits in neither tier (or the
        old state of these tokens is in use and stays). ``base`` > 0: ``data`` holds only
        ``tokens[base:]`` and needs the stored state of ``tokens[:base]`` (its parent; see
        :meth:`parent_length`) in the same tier."""
        if not tokens:
            raise ValueError("cannot store an empty prefix")
        if not 0 <= base < len(tokens):
            raise ValueError("base must be in [0, len(tokens))")
        try:
            key = self._key(ns_id, tokens)
            olds = [tree.get(key) for tree in (self._ram, self._disk)]
            was_cached = any(e is not None for e in olds)
            if any(e is not None and e.pins for e in olds):
                return False  # in use or a parent: the old state (same tokens) stays
            self._replacing.add(key)  # the new state replaces the old copies: no events
            try:
                for tree, old in zip((self._ram, self._disk), olds, strict=True):
                    if old is not None:
                        tree.remove(key)
            finally:
                self._replacing.discard(key)
            size = ram_entry_bytes(len(_as_bytes_view(data)), len(key))
            in_ram = self._link(self._ram, key, _RamItem(ns_id, data, base), size) is not None
            # write-behind: every new state is queued for disk at once
            on_disk = self._write_disk(ns_id, key, data, base)
            ok = in_ram or on_disk
            if ok:
                self.stats.puts += 1
            cached = self._ram.get(key) is not None or self._disk.get(key) is not None
            if cached != was_cached:
                self._emit("add" if cached else "remove", ns_id, key)
            self._wait_for_writer()
            return ok
        finally:
            self._update_sizes()
            self._flush_changes()

    @_locked
    def parent_length(self, ns_id: bytes, tokens: Sequence[int]) -> int:
        """Length of the longest stored prefix of ``tokens`` (RAM first, else disk) that a
        segment for ``tokens`` could be based on; 0 if none. Not a use."""
        key = self._key(ns_id, tokens)
        for tree in (self._ram, self._disk):
            entry = tree.longest_prefix_entry(key[:-1])
            if entry is not None:
                return len(entry.tokens) - 1
        return 0

    @_locked
    def branch_point(self, ns_id: bytes, tokens: Sequence[int]
                     ) -> tuple[int, tuple[int, ...] | None, int]:
        """(L, other, other_base): ``tokens`` share L tokens with the stored RAM state of
        ``other`` and diverge from it there (0 < L < both lengths); ``other_base`` is where
        that state's own segment starts. (0, None, 0) if there is no such state."""
        return branch_point(self._ram, self._key(ns_id, tokens))

    @_locked
    def rebase(self, ns_id: bytes, tokens: Sequence[int], new_base: int, data) -> bool:
        """Replace the state of ``tokens`` by a shorter segment ``data`` (tokens
        [new_base:]) on the stored state of ``tokens[:new_base]``, in each tier that holds
        both; the old parent's pin moves to the new parent. True if any tier changed."""
        try:
            key = self._key(ns_id, tokens)
            new_parent_key = key[: new_base + 1]
            changed = False
            for tree in (self._ram, self._disk):
                entry, parent = tree.get(key), tree.get(new_parent_key)
                if entry is None or parent is None or not 0 <= entry.payload.base < new_base:
                    continue
                if not self._under(tree, parent, entry.payload.base):
                    continue  # the new parent must extend the old one (same chain)
                item = entry.payload
                tree.pin(parent)
                parent.payload.children.add(key)
                self._unlink(tree, key, item)
                item.base = new_base
                n = len(_as_bytes_view(data))
                if tree is self._ram:
                    item.data = data
                    tree.insert(key, item, ram_entry_bytes(n, len(key)))  # smaller
                else:
                    item.size = self._file_size(key, n, new_base)
                    item.data = data
                    item.gen += 1
                    tree.insert(key, item, item.size)
                    self._enqueue(key, item)
                changed = True
            return changed
        finally:
            self._update_sizes()
            self._flush_changes()

    @staticmethod
    def _under(tree: RadixTree, entry: Entry, base: int) -> bool:
        """Whether ``entry``'s chain reaches down to exactly ``base`` tokens."""
        while len(entry.tokens) - 1 > base:
            if entry.payload.base < base:
                return False
            if entry.payload.base == base:
                return True
            entry = tree.get(entry.tokens[: entry.payload.base + 1])
        return len(entry.tokens) - 1 == base

    @_locked
    def remove(self, ns_id: bytes, tokens: Sequence[int]) -> bool:
        """Drop ``tokens`` from both tiers (no demotion), with the segments based on it.
        False if absent; KVStoreError if it (or such a segment) is in use."""
        try:
            key = self._key(ns_id, tokens)
            found = False
            for tree in (self._ram, self._disk):
                if tree.get(key) is not None:
                    if not self._drop_subtree(tree, key):
                        raise KVStoreError("cannot remove a prefix that is in use")
                    found = True
            return found
        finally:
            self._update_sizes()
            self._flush_changes()

    @_locked
    def flush_to_disk(self, timeout: float | None = None) -> int:
        """Queue every RAM entry that has no disk copy (oldest first), then wait until the
        writer has written everything queued (at most ``timeout`` s). Returns how many
        states were not on disk yet when called (queued before or now)."""
        try:
            if self.model_dir is None or self._writer is None:
                return 0
            count = sum(1 for _, item, _ in self._queue if item.data is not None)
            entries = sorted(self._ram.entries(), key=lambda e: e.last_used)
            entries.sort(key=lambda e: len(e.tokens))  # parents first (stable: oldest use first)
            for entry in entries:
                if entry.stored and self._disk.get(entry.tokens) is None:
                    item: _RamItem = entry.payload
                    if self._write_disk(item.ns_id, entry.tokens, item.data, item.base):
                        count += 1
            self._wait_drained(timeout)
            return count
        finally:
            self._update_sizes()
            self._flush_changes()

    @_locked
    def wait_written(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout`` s) until every queued state is on disk; True if so."""
        if self._writer is None:
            return True
        return self._wait_drained(timeout)

    def _wait_drained(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (self._queue or self._writing) and self._writer.is_alive():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._writer_cv.wait(0.1 if left is None else min(0.1, left))
        return True

    def close(self, *, flush: bool = True, timeout: float | None = 10.0) -> bool:
        """Stop the writer thread: with ``flush``, after queueing RAM entries without a disk
        copy and letting the queue drain; without it, after the write in progress. Bounded
        by ``timeout``; whatever is still queued then is lost (a crash-consistent state:
        the next start removes temp files). True if everything queued was written."""
        with self._lock:
            if self._writer is None:
                return True
            if flush and not self._closing:
                self.flush_to_disk(timeout)
            self._closing = True
            drained = not self._queue
            # what is still queued (the write in progress included: its rename is skipped)
            # is dropped, so no write of this store lands after close returns
            for _key, item, _gen in self._queue:
                item.data = None
                item.dropped = True
            self._queue.clear()
            self._writer_cv.notify_all()
            writer = self._writer
        writer.join(timeout)
        return drained and not writer.is_alive()

    @_locked
    def prefixes(self) -> list[tuple[bytes, tuple[int, ...], str]]:
        """Every cached prefix: (ns_id, tokens, tier) with tier "ram" if it is in RAM."""
        inv = {v: k for k, v in self._ns_token.items()}
        seen: dict[tuple[int, ...], str] = {}
        for entry in self._disk.entries():
            seen[entry.tokens] = "disk"
        for entry in self._ram.entries():
            seen[entry.tokens] = "ram"
        return [(inv[k[0]], k[1:], tier) for k, tier in seen.items()]

    @_locked
    def set_budgets(self, *, ram_bytes: int | None = None, disk_bytes: int | None = None) -> None:
        try:
            for tree, cap in ((self._ram, ram_bytes), (self._disk, disk_bytes)):
                if cap is None or (tree is self._disk and self.model_dir is None):
                    continue
                # evict leaves first: a parent is pinned by its segments until they go
                while tree.used_bytes > cap and tree.evict(tree.used_bytes - cap):
                    pass
                tree.set_capacity(cap)
        finally:
            self._update_sizes()
            self._flush_changes()

    @property
    def ram_used_bytes(self) -> int:
        return self._ram.used_bytes

    @property
    def disk_used_bytes(self) -> int:
        return self._disk.used_bytes

    @_locked
    def pinned_bytes(self) -> tuple[int, int]:
        return self._ram.pinned_bytes, self._disk.pinned_bytes

    @_locked
    def _check_invariants(self) -> None:
        """For tests: budgets hold and the disk index matches the files (a queued state
        has no file yet but holds its bytes)."""
        self._ram._check_invariants()
        self._disk._check_invariants()
        if self.model_dir is not None:
            files = {p for p in self.model_dir.glob("*/*.kv")}
            entries = list(self._disk.entries())
            written = {e.payload.path for e in entries if e.payload.on_disk}
            assert files == written, (files ^ written)
            current = sum(e.payload.path.stat().st_size for e in entries
                          if e.payload.data is None)
            queued = sum(e.size_bytes for e in entries if e.payload.data is not None)
            assert current + queued == self._disk.used_bytes
        for tree in (self._ram, self._disk):
            for e in tree.entries():
                kids = e.payload.children
                assert e.pins >= len(kids)
                for k in kids:
                    child = tree.get(k)
                    assert child is not None and child.tokens[: child.payload.base + 1] == (
                        e.tokens)
                if e.payload.base:
                    parent = tree.get(e.tokens[: e.payload.base + 1])
                    assert parent is not None and e.tokens in parent.payload.children


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (best effort: some filesystems refuse)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
