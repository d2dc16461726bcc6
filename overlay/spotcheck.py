"""Spot checks: re-execute a sample of answered forwards locally and judge the next hop.

After a forwarded greedy request was answered in full by one peer,
:meth:`SpotCheckRunner.answered` draws (``overlay/core/trust.py`` ``SpotChecker``)
whether to re-run it on the local engine; :meth:`SpotCheckRunner.run` (started in the
daemon's nursery) runs the queued checks one at a time, compares the outputs and feeds
the verdict to the trust tracker. The client already has its answer: a check never
delays or changes it.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import trio

from prefixmesh.inference.backend import (
    Backend,
    BackendError,
    Completion,
    GenerateRequest,
    TokenChunk,
    TokenLogprob,
)

from .core import wire
from .core.identity import peer_id_to_b58
from .core.peerindex import PeerCacheIndex
from .core.trust import MISMATCH, SpotChecker, TrustTracker, judge_batched
from .forwarding import Observed

__all__ = ["SpotCheckRunner"]

log = logging.getLogger(__name__)

#: evidence of the last verdicts kept for the operator (``spot_log``)
_EVIDENCE_KEPT = 64


@dataclass(frozen=True)
class _SpotJob:
    peer: bytes  # the next hop we forwarded to (accountable for what it returned)
    req: wire.Request
    observed: Observed


@dataclass(frozen=True)
class _Rerun:
    """The local greedy re-execution: its pieces of text, token ids, per token how far it
    led the runner-up (nats; None where the engine gave no alternatives), and the same for
    the end-of-sequence token where it stopped by choosing one (``end_lead``)."""

    text: list[str]
    ids: list[int]
    leads: list[float | None]
    end_lead: float | None = None

    def lead_at(self, index: int | None, unit: str) -> float | None:
        """The lead of the token at ``index`` (a token index, or a character index into
        the text for ``unit`` "char"); at the end of the answer, the end-of-sequence
        token's (an answer that goes on where the re-execution stopped); None past that
        or where it is not known."""
        if index is not None and unit == "char":
            if len(self.text) != len(self.leads):
                return None  # pieces of several tokens: which one is not known
            ends = [*itertools.accumulate(map(len, self.text))]
            if index > (ends[-1] if ends else 0):
                return None
            # the piece holding that character (one token per piece); just past the text,
            # the end
            index = bisect.bisect_right(ends, index)
        if index is None:
            return None
        if index == len(self.leads):
            return self.end_lead
        return self.leads[index] if index < len(self.leads) else None


def _lead(lp: TokenLogprob) -> float | None:
    """How far the chosen token led the runner-up (None without alternatives, or where a
    grammar chose another than the most likely token). Logprobs are the model's before any
    grammar mask, so under a grammar this is a lower bound of the lead."""
    return lp.logprob - lp.top[1][1] if len(lp.top) >= 2 and lp.logprob >= lp.top[0][1] \
        else None


def _leads(chunk: TokenChunk) -> list[float | None]:
    """Per token of ``chunk``, its lead over the runner-up (:func:`_lead`)."""
    if len(chunk.logprobs) != len(chunk.token_ids):
        return [None] * len(chunk.token_ids)
    return [_lead(lp) for lp in chunk.logprobs]


class SpotCheckRunner:
    """Queues and runs spot checks; ``stats`` is the service's counter dict (shared)."""

    def __init__(self, *, checker: SpotChecker | None, backend: Backend,
                 index: PeerCacheIndex, trust: TrustTracker | None,
                 clock: Callable[[], float], stats: dict[str, int],
                 max_pending: int, timeout_s: float):
        self.checker = checker
        self.backend = backend
        self.index = index
        self.trust = trust
        self.clock = clock
        self.stats = stats
        self.max_pending = max_pending
        self.timeout_s = timeout_s
        self._send: trio.MemorySendChannel | None = None
        self.log: list[dict] = []  # the last verdicts' evidence (bounded, newest last)

    def answered(self, peer: bytes, req: wire.Request, observed: Observed) -> None:
        """Draw whether to re-execute a forwarded request that ``peer`` answered in full;
        queue the check (never awaited here: the client already has its answer)."""
        checker = self.checker
        if checker is None or self._send is None or observed.final is None:
            return
        est = self.index.estimate(peer)
        peer_model = est.model if est is not None else b""
        if not checker.should_check(temperature=req.sampling.temperature,
                                    local_model=self.backend.model_fingerprint,
                                    peer_model=peer_model):
            return
        try:
            self._send.send_nowait(_SpotJob(peer, req, observed))
        except trio.WouldBlock:
            self.stats["spot_dropped"] += 1

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run queued spot checks one at a time (the daemon starts this in its nursery).

        At most ``max_pending`` wait; more are dropped (``spot_dropped``), so checks can
        never pile up behind a busy engine."""
        send, recv = trio.open_memory_channel[_SpotJob](self.max_pending)
        self._send = send
        task_status.started()
        try:
            async with recv:
                async for job in recv:
                    try:
                        await self._check(job)
                    except Exception:  # a check must never take the node down
                        self.stats["spot_failed"] += 1
                        log.exception("spot check of %s failed", job.req.id.hex()[:8])
        finally:
            self._send = None

    def _batched(self, observed: Observed) -> bool:
        """Either side decoded in shared batches (the peer's FINAL says; our engine's
        mode): greedy outputs may then differ without anyone lying."""
        final_batched = observed.final is not None and observed.final.batched
        return final_batched or bool(getattr(self.backend, "batched", False))

    async def _rerun(self, req: wire.Request) -> _Rerun | None:
        """The local engine's greedy answer to ``req``; None when it could not run."""
        gen_req = GenerateRequest(
            ns=req.ns,
            tokens=req.tokens,
            max_tokens=req.sampling.max_tokens,
            temperature=0.0,
            top_p=req.sampling.top_p,
            seed=req.sampling.seed,
            deadline=self.clock() + self.timeout_s,
            grammar=req.grammar,  # a constrained answer is judged under its constraint
            logprobs=2,  # the runner-up of every token: how clear each choice was
        )
        text: list[str] = []
        ids: list[int] = []
        leads: list[float | None] = []
        end_lead = None
        try:
            with trio.fail_after(self.timeout_s):
                async with contextlib.aclosing(self.backend.generate(gen_req)) as events:
                    async for ev in events:
                        if isinstance(ev, TokenChunk):
                            text.append(ev.text)
                            ids.extend(ev.token_ids)
                            leads.extend(_leads(ev))
                        elif isinstance(ev, Completion) and ev.end_logprob is not None:
                            end_lead = _lead(ev.end_logprob)
        except (BackendError, trio.TooSlowError) as exc:
            # the engine could not re-execute (busy, deadline): no verdict either way
            self.stats["spot_failed"] += 1
            log.info("spot check of %s not run: %s", req.id.hex()[:8], exc)
            return None
        return _Rerun(text, ids, leads, end_lead)

    async def _check(self, job: _SpotJob) -> None:
        req, observed = job.req, job.observed
        rerun = await self._rerun(req)
        if rerun is None:
            return
        assert self.checker is not None
        if observed.ids_complete and (rerun.ids or observed.ids):
            expected, got, unit = rerun.ids, observed.ids, "token"
        else:  # the peer sent text only (stream=False): compare code points
            expected, got, unit = [ord(c) for c in "".join(rerun.text)], \
                [ord(c) for c in "".join(observed.text)], "char"
        verdict = self.checker.compare(job.peer, req.id, expected, got)
        if verdict.kind == MISMATCH and self._batched(observed):
            # batched kernels are not bit-identical to a single-sequence run: a divergence
            # at a near-tie proves nothing (drift, no penalty); at a clear choice it does
            verdict = judge_batched(verdict, rerun.lead_at(verdict.first_mismatch, unit))
        self.stats["spot_checks"] += 1
        self.stats[{"match": "spot_matches", "mismatch": "spot_mismatches"}.get(
            verdict.kind, "spot_drifts")] += 1
        before = after = None
        if self.trust is not None:
            before = self.trust.trust(job.peer, self.clock())
            after = self.trust.observe_spot_check(job.peer, self.clock(), verdict)
        serving = observed.final.serving if observed.final is not None else b""
        evidence = {
            "request_id": req.id.hex(),
            "peer": peer_id_to_b58(job.peer),
            "serving": peer_id_to_b58(serving) if serving else "",
            "kind": verdict.kind,
            "unit": unit,
            "first_mismatch": verdict.first_mismatch,
            "expected": list(verdict.expected),
            "got": list(verdict.got),
            "trust_before": before,
            "trust_after": after,
        }
        self.log.append(evidence)
        del self.log[:-_EVIDENCE_KEPT]
        if verdict.kind == MISMATCH:
            log.warning(
                "spot check MISMATCH: request %s peer %s (serving %s): %s; first mismatch at "
                "%s %s: expected %s got %s; trust %.3f -> %.3f",
                evidence["request_id"], evidence["peer"], evidence["serving"], verdict.reason,
                unit, verdict.first_mismatch, evidence["expected"], evidence["got"],
                before if before is not None else -1.0, after if after is not None else -1.0,
            )
        else:
            log.info("spot check %s: request %s peer %s: %s", verdict.kind,
                     evidence["request_id"][:8], evidence["peer"][-8:], verdict.reason)
