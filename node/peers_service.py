"""``/prefixmesh/peers/1.0.0``: answer PEERS queries without letting a flood cost much.

A reply lists up to ``wire.MAX_PEERS_LISTED`` peers (~100 KB with a full directory) and
building it walks the directory, the peer index and the heartbeat table. Unbounded, a
few identities asking in a loop keep a core busy (issue 14, adversarial suite: PEERS
query flood). So a reply is built fresh for at most :data:`FRESH_REPLIES_PER_S` queries a
second; past that the last one built is shared (it is at most :data:`REPLY_REUSE_S` old),
and each peer may ask
:data:`QUERY_RATE_PER_S` times a second after a burst of :data:`QUERY_BURST`; over it
the answer is an ``overloaded`` ERROR frame with a retry hint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prefixmesh.overlay.core import wire
from prefixmesh.overlay.core.limits import PeerRateLimiter
from prefixmesh.overlay.host import FramedStream, HostError, remote_peer

__all__ = ["FRESH_REPLIES_PER_S", "PeersService", "QUERY_BURST", "QUERY_RATE_PER_S",
           "REPLY_REUSE_S"]

log = logging.getLogger(__name__)

#: replies built fresh per second (an operator's `prefixmesh peers`, a script waiting for
#: a mesh, see the state of the moment); a flood shares the last one built ...
FRESH_REPLIES_PER_S = 4.0
#: ... which is rebuilt once it is this old: a second-old view of the mesh is as good
REPLY_REUSE_S = 1.0
#: queries one peer may send per second once its burst is spent: scripts waiting for a
#: mesh to form poll a few times a second; a flood's cost is bounded by the shared reply
#: anyway, this keeps one peer from taking the node's upload for PEERS replies
QUERY_RATE_PER_S = 10.0
QUERY_BURST = 20.0


class PeersService:
    """The PEERS handler; ``build()`` makes a fresh :class:`wire.PeersReply`."""

    def __init__(self, build: Callable[[], wire.PeersReply],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.build = build
        self.clock = clock
        self._limiter = PeerRateLimiter(QUERY_RATE_PER_S, QUERY_BURST)
        self._fresh = PeerRateLimiter(FRESH_REPLIES_PER_S, FRESH_REPLIES_PER_S, max_peers=1)
        self._encoded: bytes | None = None
        self._built_at = -1e18
        self.builds = 0
        self.answered = 0
        self.refused = 0

    def reply_bytes(self) -> bytes:
        """The encoded reply: fresh while few ask, else the last one built (module doc)."""
        now = self.clock()
        fresh = self._fresh.allow(b"", now)  # every build takes a token, the first too
        if fresh or self._encoded is None or now - self._built_at >= REPLY_REUSE_S:
            self._encoded = wire.encode_frame(self.build())
            self._built_at = now
            self.builds += 1
        return self._encoded

    async def handle(self, stream) -> None:
        fs = FramedStream(stream, timeout_s=5.0)
        try:
            try:
                peer = remote_peer(stream)
            except Exception:  # a stream without a connection (tests): one bucket
                peer = b""
            frame = await fs.receive()
            if not isinstance(frame, wire.PeersQuery):
                return
            now = self.clock()
            if not self._limiter.allow(peer, now):
                self.refused += 1
                wait = self._limiter.retry_after_s(peer, now)
                await fs.send(wire.Error("overloaded",
                                         f"peers query rate limit: retry in {wait:.1f} s"))
                return
            await fs.write_bytes(self.reply_bytes())
            self.answered += 1
        except (HostError, wire.WireError) as exc:
            log.debug("peers query failed: %s", exc)
        finally:
            await fs.close()
