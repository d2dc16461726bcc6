"""Whole-frame deadlines in FramedStream (issue 14, finding 2): a frame must arrive
complete within frame_budget_s of its announced size from its first byte, however the
bytes trickle; waiting for a frame to begin is still governed by the per-read timeout.
Runs on trio's mock clock (autojump), so the trickle takes no wall time."""

from __future__ import annotations

import struct

import pytest
import trio
import trio.testing

from prefixmesh.overlay.core import wire
from prefixmesh.overlay.core.streamslots import frame_budget_s
from prefixmesh.overlay.host import FramedStream, FrameTimeout, PeerTimeout


class TrickleStream:
    """Yields ``chunks`` one at a time, ``gap_s`` apart (then waits forever)."""

    def __init__(self, chunks: list[bytes], gap_s: float, first_after_s: float = 0.0):
        self.chunks = list(chunks)
        self.gap_s = gap_s
        self.first_after_s = first_after_s
        self.reads = 0

    async def read(self, n: int) -> bytes:
        await trio.sleep(self.first_after_s if self.reads == 0 else self.gap_s)
        self.reads += 1
        if not self.chunks:
            await trio.sleep_forever()
        return self.chunks.pop(0)


def _run(coro_fn):
    return trio.run(coro_fn, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_trickled_frame_is_cut_at_its_whole_frame_budget():
    announced = 512 * 1024
    chunks = [struct.pack(">I", announced)] + [b"\0"] * 10_000  # one byte every 5 s

    async def main():
        fs = FramedStream(TrickleStream(chunks, gap_s=5.0), timeout_s=10.0)
        t0 = trio.current_time()
        with pytest.raises(FrameTimeout, match="not complete within"):
            await fs.receive()
        return trio.current_time() - t0

    took = _run(main)
    budget = frame_budget_s(announced, wire.MAX_FRAME_BYTES)
    assert budget <= took <= budget + 5.0 + 0.1  # per-read timeouts never extended it


def test_a_trickled_raw_message_is_cut_too():
    chunks = [b"\0\x10"] + [b"\0"] * 1000  # even the length prefix trickles (1 MiB)

    async def main():
        fs = FramedStream(TrickleStream(chunks, gap_s=3.0), timeout_s=10.0)
        with pytest.raises(FrameTimeout):
            await fs.receive_raw(max_bytes=8 * 1024 * 1024)

    _run(main)


def test_waiting_for_a_frame_to_begin_is_the_per_read_timeout_and_a_slow_whole_frame_passes():
    frame = wire.encode_frame(wire.Ping(7))
    pieces = [frame[i:i + 1] for i in range(len(frame))]

    async def main():
        # begins after 50 s (per-read timeout 60 s): fine; then a byte every 0.2 s, within
        # the budget of a small frame (FRAME_BASE_S)
        assert len(frame) * 0.2 < frame_budget_s(len(frame), wire.MAX_FRAME_BYTES)
        fs = FramedStream(TrickleStream(pieces, gap_s=0.2, first_after_s=50.0), timeout_s=60.0)
        got = await fs.receive()
        assert got == wire.Ping(7)
        # and a second frame on the same stream gets its own budget
        fs2 = FramedStream(TrickleStream(pieces + pieces, gap_s=0.2), timeout_s=60.0)
        assert await fs2.receive() == wire.Ping(7)
        assert await fs2.receive() == wire.Ping(7)
        # nothing at all: the per-read timeout, a plain PeerTimeout
        fs3 = FramedStream(TrickleStream([], gap_s=1.0), timeout_s=2.0)
        with pytest.raises(PeerTimeout) as ei:
            await fs3.receive()
        assert not isinstance(ei.value, FrameTimeout)

    _run(main)
