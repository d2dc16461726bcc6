"""Full or partial replication of cache digests: one interface, two implementations (pure).

A node's own cache changes and load figures go into its digest stream, and its router
reads peers' digests through a :class:`~.planner.CacheView`. Which stream and which
view depends on the replication mode, and the two always go together:

- :class:`FullReplication`: one :class:`~.antientropy.AntiEntropy` stream gossiped to
  every peer; routers read the :class:`~.peerindex.PeerCacheIndex` (``FullView``);
- :class:`PartialReplication`: one stream per partition, pushed to its homes
  (:class:`~.partition.PartitionedDigest`); routers read a home's index, a carried holder
  list or a lookup answer (``PartitionedView``).

The node (``node/daemon.py``) and the simulator (``bench/sim.py``) pick one at start and
then call the same three methods, so neither branches on the mode (py-libp2p's
``IPubsubRouter`` style: one interface, several implementations instead of flags).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from .antientropy import AntiEntropy
from .digest import LoadFigures
from .partition import PartitionedDigest
from .peerindex import PeerCacheIndex
from .planner import CacheView, FullView, PartitionedView

__all__ = ["Replication", "FullReplication", "PartialReplication"]


class Replication(Protocol):
    view: CacheView

    def add(self, ns: bytes, chain: Sequence[bytes], now: float) -> None: ...

    def remove(self, ns: bytes, chain: Sequence[bytes], now: float) -> None: ...

    def set_local_load(self, load: LoadFigures, capacity: int, used: int) -> None: ...

    def set_local_addrs(self, addrs: Sequence[str], now: float) -> None: ...


class FullReplication:
    __slots__ = ("ae", "view")

    def __init__(self, ae: AntiEntropy, index: PeerCacheIndex, model: bytes) -> None:
        self.ae = ae
        self.view = FullView(index, model)

    def add(self, ns: bytes, chain: Sequence[bytes], now: float) -> None:
        self.ae.local_add_prefix(ns, chain)

    def remove(self, ns: bytes, chain: Sequence[bytes], now: float) -> None:
        self.ae.local_remove_prefix(ns, chain)

    def set_local_load(self, load: LoadFigures, capacity: int, used: int) -> None:
        self.ae.set_local_load(load, capacity, used)

    def set_local_addrs(self, addrs: Sequence[str], now: float) -> None:
        """New addresses go out in a fresh record now (the exchange gossips it)."""
        self.ae.set_local_addrs(addrs)
        self.ae.restate(now)


class PartialReplication:
    __slots__ = ("pd", "view")

    def __init__(self, pd: PartitionedDigest, members: Callable[[], Iterable[bytes]]) -> None:
        self.pd = pd
        self.view = PartitionedView(pd, members)

    def add(self, ns: bytes, chain: Sequence[bytes], now: float) -> None:
        self.pd.local_add_prefix(ns, chain, now)

    def remove(self, ns: bytes, chain: Sequence[bytes], now: float) -> None:
        self.pd.local_remove_prefix(ns, chain, now)

    def set_local_load(self, load: LoadFigures, capacity: int, used: int) -> None:
        self.pd.set_local_load(load, capacity, used)

    def set_local_addrs(self, addrs: Sequence[str], now: float) -> None:
        """Every partition stream restates with the new addresses at the next tick."""
        self.pd.set_local_addrs(addrs)
