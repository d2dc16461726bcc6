"""OverlayHost: concrete addresses, deadlines on dial and reads, pooled streams (in-process,
real libp2p over loopback)."""

from __future__ import annotations

import contextlib
import time

import pytest
import trio

from prefixmesh.overlay.core import wire
from prefixmesh.overlay.core.identity import Identity
from prefixmesh.overlay.host import FramedStream, OverlayHost, PeerTimeout, PeerUnreachable


def test_unspecified_listen_address_is_never_advertised():
    async def main():
        host = OverlayHost(Identity.generate(), ["/ip4/0.0.0.0/tcp/0"])
        async with host.run():
            addrs = host.listen_addrs()
            assert addrs and all("/ip4/0.0.0.0/" not in a for a in addrs)
            assert any(a.startswith("/ip4/127.0.0.1/tcp/") for a in addrs)
            assert all(not a.endswith("/tcp/0") for a in addrs)
            assert all(a.endswith(f"/p2p/{host.identity.peer_id_b58}") for a in host.full_addrs())

    trio.run(main)


def test_dial_to_a_silent_listener_times_out():
    async def main():
        # accepts TCP connections and never says a word: py-libp2p alone would hang
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        accepted = []

        async def hold(stream):
            accepted.append(stream)
            await trio.sleep_forever()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, hold, listeners)
            host = OverlayHost(Identity.generate(), [], dial_timeout_s=1.0)
            async with host.run():
                t0 = time.monotonic()
                with pytest.raises((PeerTimeout, PeerUnreachable)):
                    await host.connect(Identity.generate().peer_id, [f"/ip4/127.0.0.1/tcp/{port}"])
                assert time.monotonic() - t0 < 3.0
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_read_deadline_and_pooled_streams():
    async def main():
        a, b = OverlayHost(Identity.generate()), OverlayHost(Identity.generate())
        served = []

        async def silent(stream):
            await trio.sleep(5)

        async def echo(stream):
            fs = FramedStream(stream)
            frame = await fs.receive(timeout_s=30)
            if frame is not None:
                served.append(frame)
                await fs.send(wire.Pong(frame.nonce))
            await fs.close()

        b.set_handler("/test/silent", silent)
        b.set_handler("/test/echo", echo)
        async with a.run(), b.run():
            await a.connect(b.peer_id, b.listen_addrs(), 5)
            fs = FramedStream(await a.open_stream(b.peer_id, "/test/silent"), timeout_s=0.5)
            with pytest.raises(PeerTimeout):
                await fs.receive()
            # first take: no spare yet; a refill makes the second take a pooled one
            stream, pooled = await a.take_stream(b.peer_id, "/test/echo")
            assert not pooled
            a.refill_pool(b.peer_id, "/test/echo")
            with trio.fail_after(5):
                while not a._pool.get((b.peer_id, "/test/echo")):
                    await trio.sleep(0.01)
            stream2, pooled2 = await a.take_stream(b.peer_id, "/test/echo")
            assert pooled2 and a.pool_hits == 1
            for s, nonce in ((stream, 1), (stream2, 2)):
                fs = FramedStream(s)
                await fs.send(wire.Ping(nonce))
                assert await fs.receive() == wire.Pong(nonce)
            assert [f.nonce for f in served] == [1, 2]
            a.refill_pool(b.peer_id, "/test/echo")
            with trio.fail_after(5):
                while not a._pool.get((b.peer_id, "/test/echo")):
                    await trio.sleep(0.01)
            a.drop_pool(b.peer_id)
            assert not a._pool.get((b.peer_id, "/test/echo"))

    trio.run(main)


def test_benchmark_link_delay_delays_each_frame_in_order():
    """``set_link_delay`` (bench swarm without netem): every frame leaves at least the
    delay after it was handed over, in order; 0 (the default) restores plain sends."""
    from prefixmesh.overlay import host as host_mod

    async def main():
        a, b = OverlayHost(Identity.generate()), OverlayHost(Identity.generate())
        got: list[tuple[int, float]] = []

        async def sink(stream):
            fs = FramedStream(stream)
            while (frame := await fs.receive(timeout_s=10)) is not None:
                got.append((frame.nonce, trio.current_time()))

        b.set_handler("/test/sink", sink)
        async with a.run(), b.run():
            await a.connect(b.peer_id, b.listen_addrs(), 5)
            fs = FramedStream(await a.open_stream(b.peer_id, "/test/sink"))
            host_mod.set_link_delay(0.3)
            try:
                t0 = trio.current_time()
                for nonce in (1, 2, 3):
                    await fs.send(wire.Ping(nonce))
            finally:
                host_mod.set_link_delay(0.0)
            await fs.close()
            with trio.fail_after(5):
                while len(got) < 3:
                    await trio.sleep(0.01)
        assert [n for n, _ in got] == [1, 2, 3]
        assert got[0][1] - t0 >= 0.3
        with pytest.raises(ValueError):
            host_mod.set_link_delay(-1.0)

    trio.run(main)


def test_inbound_subnet_cap_closes_connections_past_a_subnets_share():
    """H admits one inbound peer per subnet (loopback counted here): A's connection stays,
    B's (same 127.0.0.0/24) is closed as soon as it is registered; H's own dial to B is
    outbound and not counted; once A is down, B's dial reclaims A's slot."""
    from prefixmesh.overlay.core.limits import InboundSubnetCap  # noqa: PLC0415

    async def echo(stream):
        fs = FramedStream(stream)
        frame = await fs.receive(timeout_s=10)
        if frame is not None:
            await fs.send(wire.Pong(frame.nonce))
        await fs.close()

    async def ping(src, dst, nonce) -> bool:
        try:
            fs = FramedStream(await src.open_stream(dst.peer_id, "/test/echo", 2), timeout_s=2)
            await fs.send(wire.Ping(nonce))
            return await fs.receive() == wire.Pong(nonce)
        except Exception:
            return False

    async def wait(predicate, timeout_s=5.0):
        with trio.fail_after(timeout_s):
            while not predicate():
                await trio.sleep(0.02)

    async def main():
        cap = InboundSubnetCap(1, exempt_loopback=False)
        h = OverlayHost(Identity.generate(), inbound_cap=cap)
        a, b = OverlayHost(Identity.generate()), OverlayHost(Identity.generate())
        h.set_handler("/test/echo", echo)
        b.set_handler("/test/echo", echo)
        async with h.run(), b.run():
            async with a.run():
                await a.connect(h.peer_id, h.listen_addrs(), 5)
                assert await ping(a, h, 1)
                assert cap.counts() == {"127.0.0.0/24": 1}
                with contextlib.suppress(Exception):
                    await b.connect(h.peer_id, h.listen_addrs(), 5)
                await wait(lambda: h.inbound_refused == 1 and not h.is_connected(b.peer_id))
                assert cap.counts() == {"127.0.0.0/24": 1}
                assert await ping(a, h, 2)  # A is unaffected
                # our own dial is ours to choose: not counted, not refused
                await h.connect(b.peer_id, b.listen_addrs(), 5)
                assert await ping(h, b, 3)
                await h.disconnect(b.peer_id)
                # A freezes (its connection lingers at H) until the heartbeat calls it
                # down: then B's dial reclaims A's slot
                with contextlib.suppress(Exception):
                    await b.connect(h.peer_id, h.listen_addrs(), 5)
                await wait(lambda: h.inbound_refused == 2)
                h.peer_is_down = lambda p: p == a.peer_id
                await wait(lambda: not h.is_connected(b.peer_id))
                await b.connect(h.peer_id, h.listen_addrs(), 5)
                assert await ping(b, h, 4)
                assert cap.counts() == {"127.0.0.0/24": 1} and h.inbound_refused == 2
                await wait(lambda: not h.is_connected(a.peer_id))  # the stale one was closed
            # a peer that stops cleanly closes its connection: its slot is free at once
            await b.disconnect(h.peer_id)
            await wait(lambda: cap.counts() == {})

    trio.run(main)


def test_an_error_a_nursery_wrapped_alone_comes_out_as_itself():
    import pytest
    import trio

    from prefixmesh.overlay.host import unwrapping_lone_exception

    async def fail(what: str) -> None:
        raise ValueError(what)

    async def one() -> None:
        with unwrapping_lone_exception():
            async with trio.open_nursery() as outer:
                async with trio.open_nursery() as inner:  # nested, as in libp2p's run
                    inner.start_soon(fail, "alone")
                outer.cancel_scope.cancel()

    async def two() -> None:
        with unwrapping_lone_exception():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fail, "a")
                nursery.start_soon(fail, "b")

    with pytest.raises(ValueError, match="alone"):
        trio.run(one)
    with pytest.raises(BaseExceptionGroup) as group:
        trio.run(two)
    assert sorted(str(e) for e in group.value.exceptions) == ["a", "b"]


def test_a_write_cancelled_midway_neither_drops_a_frame_nor_breaks_the_connection():
    """py-libp2p's Noise session encrypts before it awaits the connection's write lock: a
    cancellation landing there used to drop an encrypted message, after which the peer
    could decrypt nothing and reset the connection (a request's deadline firing while a
    token was relayed: the client saw the stream end without the node's ``deadline``
    ERROR). Cancelled at every step of the write, each frame still arrives whole, and so
    does the next one."""

    async def main():
        a, b = OverlayHost(Identity.generate()), OverlayHost(Identity.generate())
        got: list = []

        async def sink(stream):
            fs = FramedStream(stream, timeout_s=5)
            while (frame := await fs.receive()) is not None:
                got.append(frame.nonce)
            got.append("EOF")

        b.set_handler("/test/sink", sink)
        async with a.run(), b.run():
            await a.connect(b.peer_id, b.listen_addrs(), 5)
            fs = FramedStream(await a.open_stream(b.peer_id, "/test/sink"))
            sent: list[int] = []
            for steps in range(12):  # the cancellation arrives after this many scheduler steps
                with trio.CancelScope() as scope:

                    async def cancel_later(n=steps, scope=scope):
                        for _ in range(n):
                            await trio.lowlevel.cancel_shielded_checkpoint()
                        scope.cancel()

                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(cancel_later)
                        await fs.send(wire.Ping(100 + steps))
                await fs.send(wire.Ping(200 + steps))
                sent += [100 + steps, 200 + steps]
            with trio.fail_after(5):
                while len(got) < len(sent):
                    await trio.sleep(0.01)
            assert got == sent
            await fs.close()

    trio.run(main)
