"""Per-peer limits on the digest responder (overlay/gossip.py), with real libp2p hosts on
127.0.0.1 in one process: a peer opening exchanges in a tight loop is refused after its
burst while an honest peer's exchanges keep succeeding and its records keep applying; a
peer cannot hold more than ``max_exchanges_per_peer`` responder exchanges open; records
beyond the responder's own byte budget are paid for from the same bucket before any is
verified.

The responder's rate limiter reads an injected clock (``limit_clock``) that the test
moves by hand, so the counts are exact and nothing depends on how fast this machine is.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import trio

from prefixmesh.overlay.core import wire
from prefixmesh.overlay.core.antientropy import AntiEntropy
from prefixmesh.overlay.core.exchange import decode_reply, encode_records, encode_summary
from prefixmesh.overlay.core.identity import Identity
from prefixmesh.overlay.core.peerindex import PeerCacheIndex
from prefixmesh.overlay.core.trust import InvalidTrustConfig
from prefixmesh.overlay.gossip import Gossip
from prefixmesh.overlay.host import FramedStream, HostError, OverlayHost

MODEL = b"model-fp-test-00"
NS = b"N" * 8


def _gossip(host: OverlayHost, identity: Identity, **kw) -> Gossip:
    ae = AntiEntropy(identity, MODEL, epoch=1, now=time.time())
    return Gossip(host, ae, PeerCacheIndex(), peers=lambda: [], **kw)


def _add_prefix(g: Gossip, k: int) -> None:
    """Give the node a new cached prefix and issue the record announcing it."""
    g.ae.local_add_prefix(NS, [bytes([k, i]) * 4 for i in range(3)])
    g.ae.tick(time.time() + 1e-3)


async def _wait_for(predicate, timeout_s: float = 10.0) -> None:
    with trio.fail_after(timeout_s):
        while not predicate():
            await trio.sleep(0.01)


def _hashes_of(g: Gossip, peer: bytes) -> int:
    est = g.index.estimate(peer)
    return 0 if est is None else est.n_hashes


def test_flooding_peer_is_refused_after_its_burst_and_honest_peer_is_unaffected():
    r_id, x_id, h_id = Identity.generate(), Identity.generate(), Identity.generate()
    clock = [1000.0]

    async def main():
        r = OverlayHost(r_id)
        x, h = OverlayHost(x_id, []), OverlayHost(h_id, [])
        g_r = _gossip(r, r_id, exchange_rate_per_s=2.0, exchange_burst=6.0,
                      exchange_timeout_s=10.0, limit_clock=lambda: clock[0])
        g_r.register()
        g_x = _gossip(x, x_id, exchange_timeout_s=10.0)
        g_h = _gossip(h, h_id, exchange_timeout_s=10.0)
        async with r.run(), x.run(), h.run():
            for peer_host in (x, h):
                await peer_host.connect(r_id.peer_id, r.listen_addrs(), 10)

            # phase 1, clock frozen: a tight loop of 20 exchanges gets exactly the burst
            for _ in range(20):
                await g_x._exchange_guarded(r_id.peer_id)
            assert g_x.stats["exchanges_ok"] == 6, g_x.stats
            assert g_x.stats["exchanges_failed"] == 14, g_x.stats
            refused = g_r.stats["exchanges_rate_limited"] + g_r.stats[
                "exchanges_concurrency_limited"]
            assert refused == 14 and g_r.stats["exchanges_rate_limited"] >= 1, g_r.stats

            # phase 2: the flood goes on while the honest peer exchanges once a second
            done = trio.Event()
            flood = [0]

            async def keep_flooding():
                while not done.is_set():
                    await g_x._exchange_guarded(r_id.peer_id)
                    flood[0] += 1

            x_ok_before = g_x.stats["exchanges_ok"]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(keep_flooding)
                for k in range(4):
                    _add_prefix(g_h, k)
                    await g_h._exchange_guarded(r_id.peer_id)
                    assert g_h.stats["exchanges_ok"] == k + 1, g_h.stats
                    # the honest peer's new record reaches the responder's peer index
                    await _wait_for(lambda k=k: _hashes_of(g_r, h_id.peer_id) == 3 * (k + 1))
                    clock[0] += 1.0  # the honest peer's pace: 1 exchange/s, under 2/s
                    await trio.sleep(0.05)
                done.set()
            assert g_h.stats["exchanges_failed"] == 0 and g_h.stats["exchanges_timed_out"] == 0
            # the flooder got at most the refill of the 4 s that passed, however hard it tried
            assert flood[0] > 8, flood
            assert g_x.stats["exchanges_ok"] - x_ok_before <= 2 * 4, g_x.stats
            assert g_r.stats["exchanges_rate_limited"] >= 14 + flood[0] - 8 - g_r.stats[
                "exchanges_concurrency_limited"]
            # the honest peer has its own bucket: never touched
            assert g_r.exchange_limiter.tokens(h_id.peer_id, clock[0]) == pytest.approx(6.0)
            await _wait_for(lambda: not g_r._gate.open)

    trio.run(main)


def test_a_peer_cannot_hold_more_than_max_exchanges_open():
    r_id, x_id, h_id = Identity.generate(), Identity.generate(), Identity.generate()

    async def main():
        r = OverlayHost(r_id)
        x, h = OverlayHost(x_id, []), OverlayHost(h_id, [])
        g_r = _gossip(r, r_id, max_exchanges_per_peer=2, exchange_timeout_s=10.0)
        g_r.register()
        g_h = _gossip(h, h_id, exchange_timeout_s=10.0)
        g_x = _gossip(x, x_id, exchange_timeout_s=10.0)
        async with r.run(), x.run(), h.run():
            for peer_host in (x, h):
                await peer_host.connect(r_id.peer_id, r.listen_addrs(), 10)
            # two exchanges opened and left silent: the responder waits on both
            held = []
            for _ in range(2):
                stream = await x.open_stream(r_id.peer_id, wire.DIGEST_PROTOCOL, 10)
                fs = FramedStream(stream, timeout_s=10)
                await fs.write_bytes(b"\0\0")  # half a length prefix: R waits for the rest
                held.append(fs)
            await _wait_for(lambda: g_r._gate.open.get(x_id.peer_id) == 2)
            # a third is reset unread (the dialer sees it while opening or on its first read)
            with trio.fail_after(5), pytest.raises(HostError):
                stream = await x.open_stream(r_id.peer_id, wire.DIGEST_PROTOCOL, 10)
                await FramedStream(stream, timeout_s=5).receive_raw()
            assert g_r.stats["exchanges_concurrency_limited"] == 1, g_r.stats
            # another peer is not affected by x's open exchanges
            _add_prefix(g_h, 1)
            await g_h._exchange_guarded(r_id.peer_id)
            assert g_h.stats["exchanges_ok"] == 1, g_h.stats
            await _wait_for(lambda: _hashes_of(g_r, h_id.peer_id) == 3)
            # once x lets go of its streams, its slots free up and it exchanges normally
            for fs in held:
                await fs.reset()
            await _wait_for(lambda: x_id.peer_id not in g_r._gate.open)
            await g_x._exchange_guarded(r_id.peer_id)
            assert g_x.stats["exchanges_ok"] == 1, g_x.stats
            assert g_r.stats["exchanges_concurrency_limited"] == 1

    trio.run(main)


def test_records_beyond_our_budget_are_charged_before_verification():
    r_id, x_id = Identity.generate(), Identity.generate()
    junk = [bytes([i % 251]) * 200 for i in range(100)]  # ~20 KiB: 5x R's 4 KiB budget

    async def exchange(x: OverlayHost, records: list[bytes]) -> None:
        stream = await x.open_stream(r_id.peer_id, wire.DIGEST_PROTOCOL, 10)
        fs = FramedStream(stream, timeout_s=10)
        await fs.send_raw(encode_summary({}))
        decode_reply(await fs.receive_raw())
        await fs.send_raw(encode_records(records))
        with contextlib.suppress(HostError):
            await fs.receive_raw()  # the responder closes once it has dealt with them
        await fs.close()

    async def main():
        r, x = OverlayHost(r_id), OverlayHost(x_id, [])
        g_r = _gossip(r, r_id, byte_budget=4096, exchange_rate_per_s=4.0, exchange_burst=8.0,
                      limit_clock=lambda: 50.0)
        g_r.register()
        async with r.run(), x.run():
            await x.connect(r_id.peer_id, r.listen_addrs(), 10)
            size = len(encode_records(junk))
            extra = (size - 4096) / 4096
            # first: 1 token for the exchange + `extra` for the records; all are checked
            await exchange(x, junk)
            await _wait_for(lambda: g_r.stats["records_rejected"] == 100)
            assert g_r.exchange_limiter.tokens(x_id.peer_id, 50.0) == pytest.approx(
                8.0 - 1 - extra)
            # second: the exchange token is there, the records' share is not: dropped unread
            await exchange(x, junk)
            await _wait_for(lambda: g_r.stats["records_rate_limited"] == 1)
            assert g_r.stats["records_rejected"] == 100
            # a message within our budget costs nothing extra
            await exchange(x, junk[:10])
            await _wait_for(lambda: g_r.stats["records_rejected"] == 110)
            assert g_r.stats["records_rate_limited"] == 1
            assert g_r.exchange_limiter.tokens(x_id.peer_id, 50.0) == pytest.approx(
                8.0 - 3 - extra)

    trio.run(main)


class _LooseStream:
    """A stream object without a libp2p connection (what some tests hand a handler)."""

    def __init__(self):
        self.resets = 0

    async def read(self, n: int = -1) -> bytes:
        return b""  # end of stream at once

    async def write(self, data: bytes) -> None:
        pass

    async def close(self) -> None:
        pass

    async def reset(self) -> None:
        self.resets += 1


def test_streams_without_a_connection_share_one_bucket():
    async def main():
        host = OverlayHost(Identity.generate())
        g = _gossip(host, host.identity, exchange_rate_per_s=1.0, exchange_burst=1.0,
                    limit_clock=lambda: 5.0)
        first, second = _LooseStream(), _LooseStream()
        await g.handle(first)  # allowed: fails on the empty stream
        await g.handle(second)  # same (empty) peer id: over the burst, reset unread
        assert (first.resets, second.resets) == (0, 1)
        assert g.stats["exchanges_failed"] == 1 and g.stats["exchanges_rate_limited"] == 1
        assert not g._gate.open

    trio.run(main)


@pytest.mark.parametrize(
    "kw",
    [{"exchange_rate_per_s": 0.0}, {"exchange_burst": 0.5},
     {"exchange_rate_per_s": float("nan")}],
)
def test_bad_limits_are_refused(kw):
    host = OverlayHost(Identity.generate())
    with pytest.raises(InvalidTrustConfig):
        _gossip(host, host.identity, **kw)


@pytest.mark.parametrize("n", [0, -1, 1.5, True])
def test_bad_max_exchanges_per_peer_is_refused(n):
    host = OverlayHost(Identity.generate())
    with pytest.raises(ValueError, match="max_exchanges_per_peer"):
        _gossip(host, host.identity, max_exchanges_per_peer=n)
