"""The daemon's start-up progress lines (``node/daemon.py``, ``_progress``): a step that
lasts longer than 2 s says so every 2 s, a quick one logs only its start and end. Pure
timing logic, run on trio's virtual clock."""

from __future__ import annotations

import logging

import trio
import trio.testing

from prefixmesh.node.daemon import _progress


def _run(step_s: float) -> list[str]:
    logger = logging.getLogger("test.progress")
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Keep()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)

    async def main() -> None:
        async with _progress("loading the model", logger):
            await trio.sleep(step_s)

    try:
        trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        logger.removeHandler(handler)
    return seen


def test_slow_step_reports_every_two_seconds():
    seen = _run(7.0)
    assert seen[0] == "loading the model ..."
    assert [m for m in seen if m.startswith("still")] == [
        "still loading the model (2 s)", "still loading the model (4 s)",
        "still loading the model (6 s)"]
    assert seen[-1].startswith("loading the model: done in ")


def test_quick_step_is_two_lines():
    seen = _run(0.5)
    assert len(seen) == 2 and seen[1].startswith("loading the model: done in ")
