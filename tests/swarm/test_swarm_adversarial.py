"""Adversarial peers with real node processes and the real model (docs/SECURITY.md).

The misbehaviour is injected with the test-only ``PREFIXMESH_FAULT`` variable
(read by ``tests/_fault_node.py``): ``wrong-tokens`` makes a node alter the tokens of requests it
serves for other nodes. Each test shows that a defence catches it end to end.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
import trio
from _swarm import Swarm, ask, free_port, peers, wait_until  # noqa: E402

from prefixmesh.overlay.core import wire  # noqa: E402

pytestmark = pytest.mark.slow

STORYTELLER = (
    "You are a storyteller. You write long, detailed stories about sailors, lighthouses, "
    "storms, maps and distant islands, with many characters and vivid descriptions. "
)
SYSTEM = STORYTELLER * 8
STORY = [("system", SYSTEM), ("user", "Tell me a long story about a lighthouse keeper.")]
# the spot-check test's two prompts (~130 tokens: a cached prefix of 7 blocks is worth a
# forward many times over; each costs the test ~4 cold prefills: cache, check, reference)
SPOT_STORY = [("system", STORYTELLER * 4), STORY[1]]
OTHER_SYSTEM = (
    "You are a careful gardener. You explain how to grow tomatoes, beans, herbs and "
    "flowers in small city gardens, season by season, with practical advice. "
) * 4
GARDEN = [("system", OTHER_SYSTEM), ("user", "How do I grow basil on a balcony?")]


def _warm(entry, server, messages) -> None:
    """Let ``server`` cache ``messages`` and wait until ``entry`` knows it (and sees the
    server idle again), so that ``entry`` forwards that prompt to ``server``."""
    wait_until(lambda: server.peer_id in {p.peer for p in peers(entry.addr).peers if p.up},
               timeout_s=30, what=f"{entry.name} to see {server.name}")
    before = {p.peer: p for p in peers(entry.addr).peers}[server.peer_id].n_hashes
    first = ask(server.addr, messages, max_tokens=2, hop_budget=0)
    assert first.final.serving == server.peer_id

    def knows():
        info = {p.peer: p for p in peers(entry.addr).peers}.get(server.peer_id)
        return info is not None and info.up and \
            info.n_hashes >= before + first.final.prompt_tokens // 16 - 1

    wait_until(knows, timeout_s=30, what=f"{entry.name} to learn {server.name}'s prefix")

    def sees_idle():  # load steers routing too: heartbeats must report the server idle
        info = {p.peer: p for p in peers(entry.addr).peers}.get(server.peer_id)
        return info is not None and info.up and info.active == 0 and info.queue_depth == 0

    wait_until(sees_idle, timeout_s=30, interval_s=0.2,
               what=f"{entry.name} to see {server.name} idle")


def _stats(node) -> dict[str, int]:
    return dict(peers(node.addr).stats)


def test_wrong_tokens_are_caught_by_spot_checks(tmp_path):
    with Swarm(tmp_path) as s:
        # A's operator endpoints show its spot checks (the overview, prefixmesh status)
        port = free_port()
        cfg = tmp_path / "A.toml"
        cfg.write_text(f'[metrics]\nlisten = "127.0.0.1:{port}"\n')
        a = s.add("A", extra=["--spot-check", "1.0", "--config", str(cfg)])
        b, c = s.add_many([("B", {"env": {"PREFIXMESH_FAULT": "wrong-tokens"}}),  # the liar
                           "C"], bootstrap=[a.addr])  # C: honest
        trust_b, trust_c = f"trust_{b.peer_b58[-8:]}", f"trust_{c.peer_b58[-8:]}"

        # honest control: C's answers are checked and match; its trust does not drop
        _warm(a, c, GARDEN)
        honest = ask(a.addr, GARDEN, max_tokens=8)
        assert honest.final.serving == c.peer_id
        stats = wait_until(lambda: (st := _stats(a)).get("infer_spot_checks", 0) >= 1 and st,
                           timeout_s=120, what="A to spot-check C's answer")
        assert stats["infer_spot_matches"] == 1 and stats["infer_spot_mismatches"] == 0
        assert stats[trust_c] >= 800

        # the faulty node: its answer reaches the client (checks never delay it), is
        # re-executed at A afterwards, and the mismatch sinks B's trust under the floor
        _warm(a, b, SPOT_STORY)
        bad = ask(a.addr, SPOT_STORY, max_tokens=8)
        assert bad.final.serving == b.peer_id
        assert bad.text.startswith("#")  # the fault is really active
        stats = wait_until(
            lambda: (st := _stats(a)).get("infer_spot_mismatches", 0) >= 1 and st,
            timeout_s=120, what="A to catch B with a spot check")
        assert stats["infer_spot_checks"] == 2
        assert stats[trust_b] < 200  # RoutingConfig.trust_floor is 0.2
        assert stats[trust_c] >= 800
        log = a.log_tail(200_000)
        line = next(ln for ln in log.splitlines() if "spot check MISMATCH" in ln)
        assert bad.final.id.hex() in line and b.peer_b58 in line
        assert "first mismatch at token 0" in line
        spot = httpx.get(f"http://127.0.0.1:{port}/prefixmesh/overview",
                         timeout=30).json()["spot_checks"]
        assert spot["fraction"] == 1.0
        assert (spot["counts"]["checks"], spot["counts"]["mismatches"]) == (2, 1)
        newest, oldest = spot["last"]
        assert (newest["kind"], newest["peer"], newest["first_mismatch"]) == \
            ("mismatch", b.peer_b58, 0)
        assert newest["request_id"] == bad.final.id.hex() and newest["trust_after"] < 0.2
        assert (oldest["kind"], oldest["peer"]) == ("match", c.peer_b58)
        assert "expected" not in newest and "got" not in newest  # no request content

        # afterwards B is no longer routed to, and the answer is the correct greedy text
        reference = ask(c.addr, SPOT_STORY, max_tokens=8, hop_budget=0)
        after = ask(a.addr, SPOT_STORY, max_tokens=8)
        assert after.final.serving != b.peer_id
        assert after.text == reference.text
        assert not reference.text.startswith("#")


def _liar_prompt(i: int) -> list[tuple[str, str]]:
    # distinct from the first block on: nobody can hold another request's prefix; ~140
    # tokens (8 blocks, the liar claims them all): the test's cost is 48 cold prefills of
    # these, and the saving a claim promises and the saving a forward requires both scale
    # with the prompt's length (a full miss costs the liar 11.3 % of its trust here, 11.6 %
    # with 12 blocks: the header's few cached tokens are a slightly larger share)
    return [("system", f"Logbook entry {i}, harbour {i * 7 % 13}. " + STORYTELLER * 3),
            ("user", f"Tell me story number {i} about the lighthouse keeper.")]


LIAR_BLOCKS = 7  # blocks of each liar prompt D's false digest claims, at least


def _forwarded_to(answer, entry, peer) -> bool:
    return any(h.peer == entry.peer_id and h.next_peer == peer.peer_id
               and h.action in ("forward", "fallback") for h in answer.final.hops)


N_REQUESTS = 24
REFERENCE_TIMEOUT_S = 300.0


def test_lying_digest_peer_loses_its_share_and_answers_stay_correct(tmp_path):
    n_prompts = N_REQUESTS
    prompts = [_liar_prompt(i) for i in range(n_prompts)]
    lies = tmp_path / "lies.json"
    lies.write_text(json.dumps(prompts))
    with Swarm(tmp_path) as s:
        a = s.add("A", extra=["--share-cap"])
        liar_env = {"PREFIXMESH_FAULT": "lie-digest", "PREFIXMESH_FAULT_PROMPTS": str(lies)}
        # D claims every prompt's prefix and holds none; E is a cold, isolated node for
        # the reference answers
        b, c, d, e = s.add_many(["B", "C", ("D", {"env": liar_env}),
                                 ("E", {"digest": False, "bootstrap": []})],
                                bootstrap=[a.addr])
        trust_d = f"trust_{d.peer_b58[-8:]}"

        def ready():
            info = {p.peer: p for p in peers(a.addr).peers}
            return all(n.peer_id in info and info[n.peer_id].up for n in (b, c, d)) and \
                info[d.peer_id].n_hashes >= n_prompts * LIAR_BLOCKS

        wait_until(ready, timeout_s=60, what="A to see B, C, D and D's (false) digest")

        # the reference answers (the model's greedy output at E, which is outside the
        # swarm) are computed meanwhile, on the other core
        references: list = []
        reference_errors: list[BaseException] = []

        def run_references() -> None:
            try:
                references.extend(ask(e.addr, p, max_tokens=4, hop_budget=0) for p in prompts)
            except BaseException as exc:  # reported by the assertion below
                reference_errors.append(exc)

        reference_run = threading.Thread(target=run_references, daemon=True)
        reference_run.start()
        # the liar's claim is the longest, so it attracts requests at first; every forward
        # to it is a full miss (it holds nothing): trust falls 12 % per miss (under the 0.2
        # floor after 11), and the share cap allows it at most half of A's forwards
        answers = [ask(a.addr, p, max_tokens=4) for p in prompts]
        to_liar = [_forwarded_to(ans, a, d) for ans in answers]
        pattern = "".join("L" if x else "." for x in to_liar)
        forwards = sum(any(h.peer == a.peer_id and h.action in ("forward", "fallback")
                           for h in ans.final.hops) for ans in answers)
        print(f"liar forwards: {pattern} ({sum(to_liar)} of {forwards} forwards)")
        assert 1 <= sum(to_liar) <= 11, pattern  # the trust floor bounds it
        assert sum(to_liar) <= max(10, forwards / 2), (pattern, forwards)  # the share cap
        late = to_liar[N_REQUESTS // 2 :]
        assert sum(late) / len(late) < 0.5, pattern  # in the second half, under the cap
        assert _stats(a)[trust_d] < 400, pattern

        # every answer is the model's greedy output: compare with the cold, isolated node
        reference_run.join(REFERENCE_TIMEOUT_S)
        assert len(references) == n_prompts, ("E did not answer every reference request",
                                              reference_errors)
        for prompt, ans, reference in zip(prompts, answers, references, strict=True):
            assert reference.final.serving == e.peer_id
            assert ans.text == reference.text, (prompt[1], ans.text, reference.text)


N_FAULT_REQUESTS = 100
FAULT_CONCURRENCY = 4
FAULT_DEADLINE_S = 30.0


def test_hundred_requests_survive_a_kill_and_a_freeze(tmp_path):
    """100 short requests, 4 at a time, through a 4-node swarm; one serving node is
    ``kill -9``ed after 30 and another SIGSTOPped after 60: every request ends with an
    answer or a clear ERROR frame within its deadline (none lost, none hung)."""
    from prefixmesh.node.client import Client, RequestFailed

    with Swarm(tmp_path) as s:
        a = s.add("A")
        b, c, d = s.add_many("BCD", bootstrap=[a.addr])
        _warm(a, b, STORY)  # B and C hold the shared prefix: A forwards to them
        _warm(a, c, STORY)
        wait_until(lambda: d.peer_id in {p.peer for p in peers(a.addr).peers if p.up},
                   timeout_s=30, what="A to see D")
        outcomes: list[tuple[int, str, str, float]] = []  # (i, kind, serving/code, seconds)
        started = {"n": 0}
        messages_of_errors: list[str] = []

        async def one(i: int, limiter: trio.CapacityLimiter) -> None:
            async with limiter:
                started["n"] += 1
                if started["n"] == 31:
                    b.kill()
                if started["n"] == 61:
                    c.send_signal(signal.SIGSTOP)
                messages = [("system", SYSTEM), ("user", f"Give me a one-word name number {i}.")]
                t0 = time.monotonic()
                try:
                    async with Client.connect(a.addr) as client:
                        ans = await client.ask(messages, max_tokens=4,
                                               deadline_s=FAULT_DEADLINE_S)
                    outcomes.append((i, "answer", ans.final.serving.hex(),
                                     time.monotonic() - t0))
                except RequestFailed as exc:
                    outcomes.append((i, "error", exc.code, time.monotonic() - t0))
                    messages_of_errors.append(f"{i}: {exc.code}: {exc}")

        async def main() -> None:
            limiter = trio.CapacityLimiter(FAULT_CONCURRENCY)
            async with trio.open_nursery() as nursery:
                for i in range(N_FAULT_REQUESTS):
                    nursery.start_soon(one, i, limiter)

        try:
            trio.run(main)
        finally:
            c.send_signal(signal.SIGCONT)
        answered = [o for o in outcomes if o[1] == "answer"]
        errors = [o for o in outcomes if o[1] == "error"]
        served_by = {
            name: sum(o[2] == n.peer_id.hex() for o in answered)
            for name, n in (("A", a), ("B", b), ("C", c), ("D", d))
        }
        # speed before the faults vs after (reported, not asserted: see BENCHMARKS.md)
        by_i = {o[0]: o[3] for o in answered}
        before = sorted(by_i[i] for i in range(30) if i in by_i)
        after = sorted(by_i[i] for i in range(70, N_FAULT_REQUESTS) if i in by_i)
        print(f"answered {len(answered)}, errors {messages_of_errors}, "
              f"served by {served_by}, slowest {max(o[3] for o in outcomes):.1f} s, "
              f"median latency requests 0-29 {before[len(before) // 2] if before else -1:.2f} s, "
              f"70-99 {after[len(after) // 2] if after else -1:.2f} s")
        assert sorted(o[0] for o in outcomes) == list(range(N_FAULT_REQUESTS))  # none lost
        assert all(o[3] <= FAULT_DEADLINE_S + 5.0 for o in outcomes)  # none hung
        # errors are allowed, as clear ERROR frames (RequestFailed with a code); a valid
        # request should rarely need one: at most a few around the faults
        assert len(errors) <= 5, (messages_of_errors, s.logs())
        assert b.proc.poll() is not None  # really killed
        assert served_by["B"] + served_by["C"] >= 1  # the faulty nodes were really in use


def test_one_peer_cannot_hold_more_than_its_share_of_infer_streams(tmp_path):
    """A peer that opens many infer streams and sends nothing gets ``overloaded`` past
    ``InferSettings.max_streams_per_peer`` (64); other clients are still served."""
    from prefixmesh.node.client import Client
    from prefixmesh.overlay.host import FramedStream
    from prefixmesh.overlay.infer import InferSettings

    limit = InferSettings().max_streams_per_peer
    with Swarm(tmp_path) as s:
        a = s.add("A", backend="sim", digest=False)

        async def main():
            async with Client.connect(a.addr) as greedy:
                idle = [await greedy.host.open_stream(a.peer_id, wire.INFER_PROTOCOL, 10.0)
                        for _ in range(limit)]
                extra = FramedStream(
                    await greedy.host.open_stream(a.peer_id, wire.INFER_PROTOCOL, 10.0),
                    timeout_s=10.0)
                refused = await extra.receive()
                async with Client.connect(a.addr) as other:  # another peer: still served
                    answer = await other.ask([("user", "hello")], max_tokens=2)
                for st in idle:
                    await FramedStream(st, timeout_s=5.0).close()
                await trio.sleep(0.5)
                again = await greedy.ask([("user", "hello")], max_tokens=2)  # slots freed
                return refused, answer, again

        refused, answer, again = trio.run(main)
        assert isinstance(refused, wire.Error) and refused.code == "overloaded", refused
        assert "this peer" in refused.message
        assert answer.final.serving == a.peer_id
        assert again.final.serving == a.peer_id
