"""A rewriting relay for tenant requests (issue 14, finding 3), as an outsider would write it.

A relay needs no namespace secret: it receives a tenant's REQUEST frame and passes it on.
This one is a plain py-libp2p host (Noise only) that takes a captured REQUEST frame
(``u32be length || canonical CBOR map``, documented in overlay/core/wire.py), does what
any relay does (decrements the hop budget ``hb``, appends its own peer id to the visited
list ``v``), optionally rewrites the content (the prompt token ids ``tok``, packed u32
little-endian, or the sampling list ``s``), re-encodes canonically and sends it to the
serving node on ``/prefixmesh/infer/1.0.0``; it returns the frames that came back, decoded.

Before the fix the credential bound only the id and the deadline, so a rewritten prompt
was served. Nothing here imports prefixmesh.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import cbor2
import trio

from .digest_flood import make_host

INFER_PROTOCOL = "/prefixmesh/infer/1.0.0"


def rewrite_prompt(obj: dict) -> None:
    """Replace the prompt with other token ids (same length)."""
    n = len(obj["tok"]) // 4
    obj["tok"] = struct.pack(f"<{n}I", *[(i * 7 + 3) % 200 for i in range(n)])


def rewrite_sampling(obj: dict) -> None:
    """Ask for many more tokens, at a high temperature."""
    obj["s"] = [512, 1.5, obj["s"][2], obj["s"][3]]


async def _read_frame(stream, buf: bytearray) -> dict:
    while len(buf) < 4 or len(buf) < 4 + struct.unpack(">I", buf[:4])[0]:
        buf += await stream.read(65536)
    n = struct.unpack(">I", buf[:4])[0]
    body = bytes(buf[4:4 + n])
    del buf[:4 + n]
    return cbor2.loads(body)


async def relay(victim_addr: str, frame: bytes,
                rewrite: Callable[[dict], None] | None = None,
                timeout_s: float = 30.0) -> list[dict]:
    """Relay one captured REQUEST frame to the victim; the frames it answered, decoded,
    up to and including the terminal ``end`` or ``err``."""
    import multiaddr
    from libp2p.custom_types import TProtocol
    from libp2p.peer.peerinfo import info_from_p2p_addr

    obj = cbor2.loads(frame[4:])
    host = make_host()
    info = info_from_p2p_addr(multiaddr.Multiaddr(victim_addr))
    out: list[dict] = []
    async with host.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        obj["hb"] = max(0, obj["hb"] - 1)  # what every relay does
        obj["v"] = [*obj["v"], host.get_id().to_bytes()]
        if rewrite is not None:
            rewrite(obj)
        body = cbor2.dumps(obj, canonical=True)
        with trio.fail_after(timeout_s):
            await host.connect(info)
            stream = await host.new_stream(info.peer_id, [TProtocol(INFER_PROTOCOL)])
            await stream.write(struct.pack(">I", len(body)) + body)
            buf = bytearray()
            while True:
                msg = await _read_frame(stream, buf)
                out.append(msg)
                if msg.get("t") in ("end", "err"):
                    break
            await stream.close()
    return out
