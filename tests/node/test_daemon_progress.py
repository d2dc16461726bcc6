"""The daemon's start-up progress lines (``node/daemon.py``, ``_progress``): a step that
lasts longer than 2 s says so every 2 s, a quick one logs only its start and end. Pure
timing logic, run on trio's virtual clock."""

from __future__ import annotations

import logging

import pytest
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


def test_a_step_that_fails_raises_its_own_error_not_a_group():
    """The ticker's nursery must not wrap the step's error: a model that fails to load is
    then the node's one-line error, not an "internal error" (tests/node/test_launch.py)."""
    logger = logging.getLogger("test.progress")

    class StepFailed(Exception):
        pass

    async def main() -> None:
        async with _progress("loading the model", logger):
            await trio.sleep(3.0)
            raise StepFailed("no weights")

    with pytest.raises(StepFailed, match="no weights"):
        trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_step_begun_earlier_counts_its_time_from_then():
    seen: list[str] = []
    logger = logging.getLogger("test.progress.already")

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)

    async def main() -> None:
        async with _progress("loading the model", logger, already_s=0.7):
            await trio.sleep(0.5)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert seen[-1] == "loading the model: done in 1.2 s"
