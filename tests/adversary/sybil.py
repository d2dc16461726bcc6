"""Connection floods from many identities and a PEERS query flood, as an outsider would.

Plain py-libp2p hosts (Noise only), each with a fresh Ed25519 identity:

* :func:`connection_flood`: ``n`` identities connect to the victim and hold their
  connections open (more than the victim's connection limits), until cancelled;
* :func:`peers_flood`: a few identities send PEERS queries (``{"t": "pq"}``, canonical
  CBOR behind a 4-byte big-endian length, one query per stream on
  ``/prefixmesh/peers/1.0.0``) as fast as the victim answers, until cancelled.

Nothing here imports prefixmesh.
"""

from __future__ import annotations

import struct

import cbor2
import trio

from .digest_flood import make_host

PEERS_PROTOCOL = "/prefixmesh/peers/1.0.0"
PEERS_QUERY = cbor2.dumps({"t": "pq"}, canonical=True)


def _victim(addr: str):
    import multiaddr
    from libp2p.peer.peerinfo import info_from_p2p_addr

    return info_from_p2p_addr(multiaddr.Multiaddr(addr))


async def connection_flood(victim_addr: str, n: int, figures: dict,
                           task_status=trio.TASK_STATUS_IGNORED) -> None:
    """``n`` fresh identities connect and hold; ``figures`` gets ``connected``/``refused``.
    Started (``task_status``) once every identity tried once; runs until cancelled."""
    info = _victim(victim_addr)
    figures.update(connected=0, refused=0)
    tried = trio.Semaphore(0)

    async def one() -> None:
        host = make_host()
        async with host.run(listen_addrs=[]):
            try:
                with trio.fail_after(30):
                    await host.connect(info)
                figures["connected"] += 1
            except Exception:  # refused or reset by the victim's limits
                figures["refused"] += 1
            tried.release()
            await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one)
            if i % 50 == 49:  # what a script on one machine manages
                await trio.sleep(0.1)
        for _ in range(n):
            await tried.acquire()
        task_status.started()
        await trio.sleep_forever()


async def peers_flood(victim_addr: str, identities: int, figures: dict) -> None:
    """PEERS queries in a loop from ``identities`` identities; ``figures`` counts
    ``replies``, ``refusals`` (ERROR frames) and ``reply_bytes``. Runs until cancelled."""
    from libp2p.custom_types import TProtocol

    info = _victim(victim_addr)
    figures.update(queries=0, replies=0, refusals=0, reply_bytes=0)

    async def one() -> None:
        host = make_host()
        async with host.run(listen_addrs=[]):
            await host.connect(info)
            while True:
                try:
                    with trio.fail_after(10):
                        stream = await host.new_stream(info.peer_id, [TProtocol(PEERS_PROTOCOL)])
                        await stream.write(struct.pack(">I", len(PEERS_QUERY)) + PEERS_QUERY)
                        figures["queries"] += 1
                        body = await _read_frame(stream)
                        await stream.close()
                except Exception:
                    await trio.sleep(0.05)
                    continue
                kind = cbor2.loads(body).get("t")
                figures["replies" if kind == "pr" else "refusals"] += 1
                figures["reply_bytes"] += len(body)

    async with trio.open_nursery() as nursery:
        for _ in range(identities):
            nursery.start_soon(one)


async def _read_frame(stream) -> bytes:
    buf = b""
    while len(buf) < 4 or len(buf) < 4 + struct.unpack(">I", buf[:4])[0]:
        chunk = await stream.read(65536)
        if not chunk:
            raise EOFError("stream ended")
        buf += chunk
    return buf[4 : 4 + struct.unpack(">I", buf[:4])[0]]
