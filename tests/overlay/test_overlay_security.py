"""Security of a real node process: Noise only (a plaintext dialer is refused), and bad
digest records / oversize messages are rejected, counted, and do not stop the node."""

from __future__ import annotations

import struct
import time

import cbor2
import multiaddr
import pytest
import trio
from _swarm import Swarm, ask, peers  # noqa: E402
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.network.config import ConnectionConfig
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport

from prefixmesh.overlay.core import wire  # noqa: E402
from prefixmesh.overlay.core.digest import (  # noqa: E402
    SIGNATURE_LABEL,
    DigestRecord,
    LoadFigures,
    NamespaceDelta,
    encode_body,
    sign_record,
)
from prefixmesh.overlay.core.exchange import decode_reply, encode_records, encode_summary  # noqa: E402
from prefixmesh.overlay.core.identity import Identity  # noqa: E402
from prefixmesh.overlay.gossip import summary_hash  # noqa: E402
from prefixmesh.overlay.host import FramedStream, OverlayHost, split_p2p_addr  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with Swarm(tmp_path_factory.mktemp("sec")) as s:
        yield s.add("A")


def test_plaintext_only_dialer_is_refused(node):
    peer, transport = split_p2p_addr(node.addr)

    async def main():
        kp = create_new_key_pair()
        plain = new_host(
            key_pair=kp,
            sec_opt={TProtocol(PLAINTEXT_PROTOCOL_ID): InsecureTransport(kp)},
            connection_config=ConnectionConfig(max_connections_per_peer=1, min_connections=0,
                                               low_watermark=0),
        )
        async with plain.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            with trio.fail_after(20):
                with pytest.raises(Exception) as info:
                    await plain.connect(info_from_p2p_addr(multiaddr.Multiaddr(node.addr)))
            assert not isinstance(info.value, trio.TooSlowError)
            assert plain.get_network().connections.get(info_from_p2p_addr(
                multiaddr.Multiaddr(node.addr)).peer_id) in (None, [])
        # control: a Noise dialer (our host) connects
        good = OverlayHost(Identity.generate(), [])
        async with good.run():
            await good.connect(peer, [transport], 10)
            assert good.is_connected(peer)

    trio.run(main)


def _record(identity: Identity, *, epoch: int, seq: int, hashes: tuple[bytes, ...],
            model: bytes, origin: bytes | None = None) -> DigestRecord:
    now = time.time()
    return DigestRecord(
        origin=origin or identity.peer_id, epoch=epoch, seq=seq, issued_at=now,
        expires_at=now + 60, model=model, kind="snapshot",
        namespaces=(NamespaceDelta(ns=b"N" * 8, added=hashes),),
        load=LoadFigures(0, 0, 100.0, 50.0), kv_capacity_bytes=1 << 20, kv_used_bytes=0,
        addrs=("/ip4/127.0.0.1/tcp/9",),
    )


def _envelope(body: bytes, signer: Identity, signature: bytes | None = None) -> bytes:
    sig = signature if signature is not None else signer.sign(SIGNATURE_LABEL + body)
    return cbor2.dumps([1, body, signer.public_bytes, sig], canonical=True)


def test_bad_digests_are_rejected_counted_and_node_keeps_serving(node):
    peer, transport = split_p2p_addr(node.addr)
    model = peers(node.addr).model
    x, y = Identity.generate(), Identity.generate()
    h = tuple(bytes([i]) * 8 for i in range(1, 4))

    good_x = sign_record(_record(x, epoch=5, seq=0, hashes=h, model=model), x)
    # 1. bad signature: one bit of the signature flipped
    env = cbor2.loads(good_x.raw)
    bad_sig = _envelope(env[1], x, bytes([env[3][0] ^ 1]) + env[3][1:])
    # 2. signer differs from origin: a body claiming origin y, signed by x
    mismatch = _envelope(encode_body(_record(x, epoch=1, seq=0, hashes=h, model=model,
                                             origin=y.peer_id)), x)
    # 3. replay/equivocation: same (epoch, seq) as good_x, different content
    replayed = sign_record(_record(x, epoch=5, seq=0, hashes=h[:1], model=model), x).raw
    # 4. regression: an older epoch after the newer one was applied
    regressed = sign_record(_record(x, epoch=4, seq=0, hashes=h, model=model), x).raw

    async def exchange(host: OverlayHost, raws: list[bytes]) -> None:
        stream = await host.open_stream(peer, wire.DIGEST_PROTOCOL, 10)
        fs = FramedStream(stream, timeout_s=10)
        await fs.send_raw(cbor2.dumps([0, summary_hash({})], canonical=True))
        # out of sync: "[0, false]", or the responder's bucket hashes ([7, ...], the
        # node default); a full summary is a valid next message after either
        answer = cbor2.loads(await fs.receive_raw())
        assert answer == [0, False] or answer[0] == 7, answer
        await fs.send_raw(encode_summary({}))
        decode_reply(await fs.receive_raw())
        await fs.send_raw(encode_records(raws))
        await fs.close()

    async def oversize(host: OverlayHost) -> None:
        stream = await host.open_stream(peer, wire.DIGEST_PROTOCOL, 10)
        fs = FramedStream(stream, timeout_s=10)
        await fs.write_bytes(struct.pack(">I", 200 * 1024 * 1024) + b"\0" * 1024)
        await trio.sleep(0.3)
        await fs.reset()

    async def main():
        attacker = OverlayHost(x, [])
        async with attacker.run():
            await attacker.connect(peer, [transport], 10)
            await exchange(attacker, [good_x.raw])
            await exchange(attacker, [bad_sig, mismatch, replayed, regressed])
            await oversize(attacker)
            await trio.sleep(0.5)

    trio.run(main)
    stats = peers(node.addr).stats
    assert stats.get("rejected_BadSignature", 0) >= 1, stats
    assert stats.get("rejected_SignerMismatch", 0) >= 1, stats
    assert stats.get("rejected_ReplayedRecord", 0) >= 1, stats
    assert stats.get("rejected_SequenceRegression", 0) >= 1, stats
    assert stats.get("digest_oversize_messages", 0) >= 1, stats
    # the valid record was applied: x is in the node's index with its 3 hashes
    info = {p.peer: p for p in peers(node.addr).peers}
    assert info[x.peer_id].n_hashes == 3
    assert y.peer_id not in info
    # and the node still serves
    answer = ask(node.addr, [("user", "Say hello.")], max_tokens=3)
    assert answer.final.serving == node.peer_id


def test_malformed_infer_frames_get_an_error_and_node_keeps_serving(node):
    peer, transport = split_p2p_addr(node.addr)

    async def main():
        host = OverlayHost(Identity.generate(), [])
        async with host.run():
            await host.connect(peer, [transport], 10)
            for junk in (b"\x00\x00\x00\x03abc", struct.pack(">I", 10 * 1024 * 1024)):
                stream = await host.open_stream(peer, wire.INFER_PROTOCOL, 10)
                fs = FramedStream(stream, timeout_s=10)
                await fs.write_bytes(junk)
                reply = await fs.receive()
                assert isinstance(reply, wire.Error) and reply.code == "bad_request"
                await fs.close()
            # a request with a forged credential
            stream = await host.open_stream(peer, wire.INFER_PROTOCOL, 10)
            fs = FramedStream(stream, timeout_s=10)
            model = None
            reply_peers = await _peers(host, peer)
            model = reply_peers.model
            from prefixmesh.node.tenants import Tenant, default_tenant_specs

            tenant = Tenant.derive(default_tenant_specs()[0], model)
            await fs.send(wire.Request(id=b"r" * 16, ns=tenant.ns_id, credential=b"\0" * 32,
                                       messages=(wire.Message("user", "hi"),),
                                       deadline=time.time() + 30))
            reply = await fs.receive()
            assert isinstance(reply, wire.Error) and reply.code == "unauthorized"

    async def _peers(host, peer):
        stream = await host.open_stream(peer, wire.PEERS_PROTOCOL, 10)
        fs = FramedStream(stream, timeout_s=10)
        await fs.send(wire.PeersQuery())
        return await fs.receive()

    trio.run(main)
    assert ask(node.addr, [("user", "Say hi.")], max_tokens=2).final.serving == node.peer_id
