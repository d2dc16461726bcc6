"""overlay/spotcheck.py: queued re-executions judge what a next hop returned.

The engine is the deterministic SimulatedBackend (the real model's spot checks run end
to end in tests/swarm/test_swarm_adversarial.py)."""

from __future__ import annotations

import collections
import contextlib
import random
import types

import trio
from hypothesis import given
from hypothesis import strategies as st

from prefixmesh.inference.backend import GenerateRequest, SimulatedBackend, TokenChunk
from prefixmesh.overlay.core import wire
from prefixmesh.overlay.core.identity import peer_id_from_public_key
from prefixmesh.overlay.core.trust import SpotChecker, TrustTracker
from prefixmesh.overlay.forwarding import Observed
from prefixmesh.overlay.spotcheck import SpotCheckRunner, _Rerun

PEER = peer_id_from_public_key(b"\x02" * 32)
REQ = wire.Request(id=b"q" * 16, ns=b"n" * 8, tokens=(5, 6, 7, 8),
                   sampling=wire.Sampling(max_tokens=6), deadline=1e12)
FINAL = wire.Final(id=REQ.id, entry=PEER, serving=PEER, prompt_tokens=4, cached_tokens=0,
                   completion_tokens=6, ttft_ms=1.0, total_ms=2.0, finish_reason="length",
                   hops=())


async def _greedy(backend) -> tuple[str, list[int]]:
    text, ids = [], []
    gen = backend.generate(GenerateRequest(ns=REQ.ns, tokens=REQ.tokens, max_tokens=6))
    async with contextlib.aclosing(gen) as events:
        async for ev in events:
            if isinstance(ev, TokenChunk):
                text.append(ev.text)
                ids.extend(ev.token_ids)
    return "".join(text), ids


class _Index:
    """The one thing the runner asks the peer index: which model a peer's digest names."""

    def __init__(self, model: bytes) -> None:
        self.model = model

    def estimate(self, peer: bytes):
        return types.SimpleNamespace(model=self.model)


def _run(observed_of, fraction=1.0, peer_model=b"simulated-model", wait_s=10.0):
    backend = SimulatedBackend()
    trust = TrustTracker()
    stats: collections.Counter = collections.Counter()
    runner = SpotCheckRunner(checker=SpotChecker(rng=random.Random(0), fraction=fraction),
                             backend=backend, index=_Index(peer_model), trust=trust,
                             clock=lambda: 100.0, stats=stats, max_pending=2, timeout_s=30.0)

    async def main():
        text, ids = await _greedy(backend)
        async with trio.open_nursery() as nursery:
            await nursery.start(runner.run)
            for observed in observed_of(text, ids):
                runner.answered(PEER, REQ, observed)
            with trio.move_on_after(wait_s):
                while stats["spot_checks"] + stats["spot_dropped"] < len(observed_of(text, ids)):
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main)
    return runner, stats, trust


def test_an_honest_answer_matches_and_a_wrong_one_is_a_mismatch_with_evidence():
    def observed(text, ids):
        wrong = [*ids[:2], ids[2] + 1, *ids[3:]]
        return [Observed([text], list(ids), final=FINAL), Observed([text], wrong, final=FINAL)]

    runner, stats, trust = _run(observed)
    assert stats["spot_checks"] == 2 and stats["spot_matches"] == 1
    assert stats["spot_mismatches"] == 1
    assert [e["kind"] for e in runner.log] == ["match", "mismatch"]
    assert runner.log[1]["first_mismatch"] == 2 and runner.log[1]["unit"] == "token"
    assert trust.trust(PEER, 100.0) < 0.2  # a mismatch drops the peer under the floor


def test_text_only_answers_are_compared_by_characters():
    def observed(text, ids):
        return [Observed([text], [], ids_complete=False, final=FINAL)]

    runner, stats, _ = _run(observed)
    assert stats["spot_matches"] == 1 and runner.log[0]["unit"] == "char"


def test_answers_without_final_or_not_drawn_are_not_checked():
    backend = SimulatedBackend()
    stats: collections.Counter = collections.Counter()
    runner = SpotCheckRunner(checker=SpotChecker(rng=random.Random(0), fraction=0.0),
                             backend=backend, index=_Index(b"simulated-model"), trust=None,
                             clock=lambda: 0.0, stats=stats, max_pending=1, timeout_s=1.0)
    runner.answered(PEER, REQ, Observed(["x"], [1], final=FINAL))  # not running: ignored
    assert stats == {}


def test_a_peer_on_another_model_is_not_checked():
    def observed(text, ids):
        return [Observed([text], list(ids), final=FINAL)]

    runner, stats, _ = _run(observed, peer_model=b"another-model", wait_s=0.3)
    assert stats["spot_checks"] == 0 and runner.log == []


def test_a_divergent_batched_answer_is_a_drift_not_a_mismatch():
    """Continuous batching is not bit-identical to a single-sequence run (issue 17): a
    FINAL that says it was batched cannot prove a peer lied, so its trust stays."""
    import dataclasses

    batched = dataclasses.replace(FINAL, batched=True)

    def observed(text, ids):
        wrong = [*ids[:2], ids[2] + 1, *ids[3:]]
        return [Observed([text], wrong, final=batched)]

    runner, stats, trust = _run(observed)
    assert stats["spot_checks"] == 1 and stats["spot_mismatches"] == 0
    assert stats["spot_drifts"] == 1 and runner.log[0]["kind"] == "drift"
    assert trust.trust(PEER, 100.0) > 0.5


def test_the_lead_just_past_a_rerun_is_its_end_of_sequence_tokens():
    """An answer that goes on where the re-execution stopped differs at the end: the lead
    there is the end-of-sequence token's (how clearly the model chose to stop)."""
    rerun = _Rerun(["a", "bc", "", "d"], [1, 2, 3, 4], [0.5, 2.0, None, 3.0], end_lead=1.7)
    assert [rerun.lead_at(i, "token") for i in range(6)] == [0.5, 2.0, None, 3.0, 1.7, None]
    # characters: "a" "bc" "" "d", then the end; a piece that completes no character (a
    # partial UTF-8 sequence) holds none
    assert [rerun.lead_at(i, "char") for i in range(6)] == [0.5, 2.0, 2.0, 3.0, 1.7, None]
    assert rerun.lead_at(None, "token") is None
    stopped_at_once = _Rerun([], [], [], end_lead=4.0)
    assert stopped_at_once.lead_at(0, "char") == stopped_at_once.lead_at(0, "token") == 4.0
    assert _Rerun(["a"], [1], [0.5]).lead_at(1, "token") is None  # stopped by length


@given(st.lists(st.tuples(st.integers(0, 3), st.floats(0, 10)), max_size=12),
       st.floats(0, 10))
def test_a_characters_lead_is_the_lead_of_the_token_that_completed_it(pieces, end_lead):
    text = ["x" * n for n, _ in pieces]
    rerun = _Rerun(text, list(range(len(pieces))), [lead for _, lead in pieces], end_lead)
    owner = [k for k, (n, _) in enumerate(pieces) for _ in range(n)]  # char -> token
    for i, k in enumerate(owner):
        assert rerun.lead_at(i, "char") == rerun.lead_at(k, "token") == pieces[k][1]
    assert rerun.lead_at(len(owner), "char") == rerun.lead_at(len(pieces), "token") == end_lead
    assert rerun.lead_at(len(owner) + 1, "char") is None
