"""Stand-ins for unreachable hint peers: TCP listeners that count connections and close them.

Used by the dialing tests of both liveness implementations (heartbeat and SWIM).
"""

from __future__ import annotations

import trio

#: loopback addresses in distinct /32s (one /24: the dial gate's per-address buckets apply)
FOREIGN_IPS = [f"127.0.0.{i}" for i in range(2, 10)]


async def counting_listeners(nursery, counts: list[int]) -> int:
    """TCP listeners on 127.0.0.2..9 (one port) that count and close every connection."""
    first = await trio.open_tcp_listeners(0, host=FOREIGN_IPS[0])
    port = first[0].socket.getsockname()[1]
    listeners = list(first)
    for ip in FOREIGN_IPS[1:]:
        listeners += await trio.open_tcp_listeners(port, host=ip)

    async def count(stream):
        counts[0] += 1
        await stream.aclose()

    nursery.start_soon(trio.serve_listeners, count, listeners)
    return port
