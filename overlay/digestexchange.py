"""The digest exchange, one interface for its two variants (the trio shells of the digests).

A node runs exactly one of them: :class:`~.gossip.Gossip` (full replication: anti-entropy
push-pull with random peers, ``/prefixmesh/digest``) or :class:`~.partgossip.PartitionGossip`
(``[digest].partitions > 0``: pushes to partition homes and lookups,
``/prefixmesh/digest-part``). Both implement :class:`DigestExchange`, which is everything
the daemon and ``InferService`` use of them, the way py-libp2p's floodsub and gossipsub
implement one ``IPubsubRouter``; both take their tunables as one
:class:`ExchangeSettings`, so the daemon builds one settings value from its config and
hands it to whichever variant it constructs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = ["ExchangeSettings", "DigestExchange"]


@dataclass(frozen=True)
class ExchangeSettings:
    """The tunables of the digest exchange (one default per knob; ``node/config.py``'s
    ``[digest]`` and ``[limits]`` sections set the ones an operator may change).

    Each variant reads the fields that apply to it; the others are ignored, so one value
    built from the config serves whichever variant the node runs.
    """

    # both variants
    interval_s: float = 1.0  # one round (tick, then exchanges or pushes) per interval
    byte_budget: int = 64 * 1024  # record bytes sent per exchange / push
    exchange_timeout_s: float = 3.0  # one exchange or push, end to end
    # full replication (Gossip); the module docstring of overlay/gossip.py says why
    fanout: int = 3  # peers contacted per round
    max_message_bytes: int | None = None  # None: 2 x byte_budget + room for a full summary
    summary_hash_check: bool = True  # open with a summary hash (saves summaries when in sync)
    backstop_rounds: int = 10  # contact one random in-sync peer every this many rounds
    bucket_summaries: bool = True  # answer a differing hash with bucket hashes (message 7)
    exchange_rate_per_s: float = 4.0  # responder: exchanges a peer may open per second
    exchange_burst: float = 8.0
    max_exchanges_per_peer: int = 2  # responder: exchanges of one peer answered at once
    # partial replication (PartitionGossip); overlay/partgossip.py says why these defaults
    request_rate_per_s: float = 64.0  # responder: streams (pushes + lookups) per second
    request_burst: float = 256.0
    max_open_per_peer: int = 8  # responder: streams of one peer answered at once
    stream_idle_s: float = 20.0  # an unused push stream is closed after this


@runtime_checkable
class DigestExchange(Protocol):
    """What a node's digest exchange offers its daemon and its ``InferService``."""

    stats: Counter[str]  # the variant's own counters (unprefixed)
    rounds: int
    last_heard: dict[bytes, float]  # origin -> wall time of its last applied record

    def register(self) -> None:
        """Install the protocol's stream handler on the host (``run`` does it too)."""

    async def run(self, *, task_status: Any = ...) -> None:
        """Register, signal started, then run one round per ``interval_s`` until cancelled."""

    def tick(self) -> None:
        """Feed local changes (``before_tick``), issue own due records, expire stale ones."""

    async def round(self) -> None:
        """One tick and the round's outgoing exchanges (or pushes)."""

    def advertised_hash(self) -> bytes:
        """The summary hash to announce in heartbeat PONGs (b"": this variant has none)."""

    def node_stats(self) -> dict[str, int]:
        """The counters as ``Node.stats()`` reports them (``digest_*`` or ``part_*``)."""
