"""The one planner: what a router does with a request, decided from values (pure).

The real node (``overlay/infer.py``) and the simulator (``bench/sim.py``) both call
:meth:`Planner.plan` and only *carry out* what it returns, in the style of h11's
``Connection`` returning events:

- :class:`Serve` - run the model here;
- :class:`Forward` - try ``targets`` in order (the chosen peer, its fallbacks, then
  :data:`LOCAL` when this node may serve), carrying ``carry`` (the holder list the next
  hop decides with, partitioned digests) on the request;
- :class:`LookUp` - ask partition ``homes`` in turn who holds the chain, then plan again
  with the answer (``PlanInput.answer``; ``None`` answers from every home: plan again
  with ``may_look_up=False``);
- :class:`Reject` - answer with the stable error ``code``.

Inputs (:class:`PlanInput`) are what the node knows at decision time: its own radix
match and load, the peers that are up (:class:`PeerLink`: RTT, fresher load from a PONG,
trust, addresses), the hop budget and visited set, and a :class:`CacheView` - the one
interface to what the digests say, with two implementations: :class:`FullView` (full
replication: a :class:`~.peerindex.PeerCacheIndex`) and :class:`PartitionedView` (partial
replication: partition homes, the holder list a request carries, the lookup cache). The
planner keeps the router's :class:`~.routing.RouterMemory` (ski-rental rent, smoothed
placements) and asks the routing :class:`~.routing.Policy`.

Unified behaviour (the node and the simulator used to differ; docs/bench/sim.md):

- candidates: every peer some digest says holds a prefix of the chain, plus up to
  :data:`MAX_SHED_CANDIDATES` unmatched peers to shed load to, drawn at random from the
  eligible ones with a load figure (the simulator's rule; the node took the least loaded
  by PONG, which herds: in the simulator it raised Zipf 1.5's max/mean load from 1.23 to
  1.35);
- a peer with no load figure at all (no PONG, no digest) is not a candidate: it cannot be
  priced;
- matched tokens are ``blocks * BLOCK_TOKENS`` capped at the prompt;
- an entry node that needs a lookup asks up to :data:`LOOKUP_HOMES` live homes in turn
  (the simulator asked one; its homes always answer, so that changed nothing there);
- the holder list carried to the next hop is the decided-with list, longest first, within
  the wire limit, zero matches dropped (an empty list is no list).

Pure code: no IO, no clock (``now`` is passed in), randomness only inside the policy.
"""

from __future__ import annotations

import bisect
import operator
import random
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prefixmesh.inference.core.blocks import BLOCK_TOKENS

from .digest import LoadFigures
from .limits import SubnetLimiter
from .partition import PartitionedDigest, lookup_pays
from .peerindex import PeerCacheIndex
from .routing import (
    FORWARD,
    Candidate,
    Decision,
    Policy,
    RouteContext,
    RouterMemory,
    make_candidate,
)

__all__ = [
    "DEFAULT_RTT_S",
    "RELAY_EXTRA_RTT_S",
    "link_cost_s",
    "FrozenPeers",
    "LOCAL",
    "LOOKUP_HOMES",
    "MAX_CARRIED_HOLDERS",
    "MAX_SHED_CANDIDATES",
    "CacheView",
    "Forward",
    "fits_context",
    "FullView",
    "LookUp",
    "PartitionedView",
    "PeerLink",
    "Plan",
    "PlanInput",
    "Planner",
    "Reject",
    "Serve",
    "ViewAnswer",
    "carry_list",
]

LOCAL = b""  # the target "serve here" in Forward.targets
# A home up by the heartbeat can still be wedged or just restarted without records: ask
# a second one, never more (each costs a round trip before the request moves at all).
LOOKUP_HOMES = 2
# Unmatched peers offered to the policy to shed load to: enough for a choice, few enough
# that the cost model is not flooded with peers that save nothing.
MAX_SHED_CANDIDATES = 2
DEFAULT_RTT_S = 0.005  # a peer whose RTT was never measured: a LAN hop
# A relayed link (a /p2p-circuit connection through a relay, issue 16) costs the relay's
# extra round trip on top of the link's RTT: +5..40 ms per 1 KB round trip in the NAT lab
# (docs/bench/nat.md), the middle of that. An RTT measured over the relay includes it
# once already; charging it again is deliberate: of two links with the same RTT the
# direct one is preferred, since a relay's capacity is shared and its circuits are capped
# (bytes and duration per circuit). All-direct inputs are unchanged.
RELAY_EXTRA_RTT_S = 0.02
# Policies that never read cached matches: a lookup would only delay their requests.
CACHE_BLIND_POLICIES = frozenset({"local", "round-robin", "random", "consistent-hash"})
_POOLS_KEPT = 4  # pools a FrozenPeers keeps (N pointers each): itself + a few hops
MAX_CARRIED_HOLDERS = 256  # == wire.MAX_CARRIED_HOLDERS (the codec enforces it)


# ---------------------------------------------------------------------------- cache views


@dataclass(frozen=True)
class ViewAnswer:
    """What a cache view knows about one chain without asking anyone."""

    matches: Mapping[bytes, int] | None  # holder -> matched blocks; None: a lookup is needed
    homes: tuple[bytes, ...] = ()  # partition homes, best first (() under full replication)
    source: str = "index"  # "index" | "home" | "carried" | "cache" | "answer" | "none"


class CacheView(Protocol):
    """What the digests say about peers' caches (full index or partitioned homes)."""

    def known(self, ns: bytes, chain: Sequence[bytes], now: float,
              carried: Mapping[bytes, int] | None) -> ViewAnswer: ...

    def load_of(self, peer: bytes) -> LoadFigures | None: ...

    def vouches(self, peer: bytes) -> bool: ...

    def namespace_holders(self, ns: bytes) -> set[bytes]: ...

    def known_peers(self) -> list[bytes]: ...


class FullView:
    """Full replication: every peer's records are in one :class:`PeerCacheIndex`."""

    vouches_all = False  # vouches() reads the index per peer

    def __init__(self, index: PeerCacheIndex, model: bytes) -> None:
        self.index = index
        self.model = model

    def known(self, ns, chain, now, carried=None) -> ViewAnswer:
        return ViewAnswer(self.index.longest_matches(ns, chain) if chain else {})

    def load_of(self, peer: bytes) -> LoadFigures | None:
        est = self.index.estimate(peer)
        return est.load if est is not None else None

    def vouches(self, peer: bytes) -> bool:
        """Only peers whose digest we hold, running our model, are candidates."""
        est = self.index.estimate(peer)
        return est is not None and est.model == self.model

    def namespace_holders(self, ns: bytes) -> set[bytes]:
        return {p for p in self.index.peers() if self.index.holds_namespace(p, ns)}

    def known_peers(self) -> list[bytes]:
        return self.index.peers()


class PartitionedView:
    """Partial replication: a home's own partition index, else the carried holder list,
    else a cached lookup answer (``PartitionedDigest.known_matches``)."""

    vouches_all = True  # vouches() is True for every peer

    def __init__(self, pd: PartitionedDigest, members: Callable[[], Iterable[bytes]]) -> None:
        self.pd = pd
        self.members = members

    def known(self, ns, chain, now, carried=None) -> ViewAnswer:
        if not chain:
            return ViewAnswer({}, (), "none")
        known, homes = self.pd.known_matches(ns, chain, self.members(), now, carried=carried)
        if self.pd.peer_id in homes:
            source = "home"
        elif carried is not None:
            source = "carried"
        else:
            source = "cache" if known is not None else "none"
        return ViewAnswer(known, tuple(homes), source)

    def load_of(self, peer: bytes) -> LoadFigures | None:
        known = self.pd.load_of(peer)
        return known[0] if known is not None else None

    def vouches(self, peer: bytes) -> bool:
        # no full index to vouch for a peer's model: a peer that is up passed the Noise
        # handshake, and the serving node re-matches anyway
        return True

    def namespace_holders(self, ns: bytes) -> set[bytes]:
        return self.pd.namespace_holders(ns)

    def known_peers(self) -> list[bytes]:
        return self.pd.known_peers()

    def priced_peers(self) -> Iterable[bytes]:
        """Exactly the peers whose ``load_of`` is not None (ourselves possibly included)."""
        return self.pd.priced_peers()


# ---------------------------------------------------------------------------- inputs


def fits_context(prompt_tokens: int, context_tokens: int | None) -> bool:
    """Whether a prompt can be served by a node of this context (unknown: assume it can;
    generation needs at least one free position, hence the strict inequality)."""
    return context_tokens is None or prompt_tokens < context_tokens


@dataclass(frozen=True)
class PeerLink:
    """A peer that is up, as this node sees the link (not its digest)."""

    rtt_s: float | None = None  # None: never measured (DEFAULT_RTT_S)
    load: float | None = None  # queued + running from a fresh PONG; None: use the digest's
    addrs: tuple[str, ...] = ()  # addresses of our live connection (the subnet cap)
    context_tokens: int | None = None  # the peer's context length (its PONG); None: not said
    relayed: bool = False  # our connection goes through a relay (RELAY_EXTRA_RTT_S)


def link_cost_s(link: PeerLink) -> float:
    """The round-trip cost the planner charges for a link: its RTT (DEFAULT_RTT_S when
    never measured), plus RELAY_EXTRA_RTT_S when it goes through a relay."""
    rtt = link.rtt_s if link.rtt_s is not None else DEFAULT_RTT_S
    return rtt + RELAY_EXTRA_RTT_S if link.relayed else rtt


class FrozenPeers(dict):
    """An immutable ``PlanInput.peers`` that keeps what the planner derives from the peer
    set: a caller whose peers do not change between requests (the simulator: every node
    up, one link away) builds it once and the planner skips its per-peer scans. Plans are
    the same as with a plain mapping of the same links (a plain ``dict`` is what the node
    passes). A ``dict`` (C-speed reads) whose mutators raise ``TypeError``."""

    __slots__ = ("ids", "sorted_ids", "loaded", "limited", "terms", "_pools")

    def __init__(self, links: Mapping[bytes, PeerLink]) -> None:
        super().__init__(links)
        self.ids = frozenset(self)
        self.sorted_ids = tuple(sorted(self))
        self.loaded = frozenset(p for p, link in self.items() if link.load is not None)
        self.limited = tuple((p, link.context_tokens) for p, link in self.items()
                             if link.context_tokens is not None)
        # what _priced reads of each link: its PONG load and link_cost_s, computed once
        self.terms = {p: (link.load, link_cost_s(link)) for p, link in self.items()}
        # _sorted_pool's answers by left-out set: a router sees few distinct ones (itself,
        # plus the previous hop of a forwarded request); bounded, oldest dropped
        self._pools: dict[frozenset[bytes], tuple[bytes, ...]] = {}

    def _immutable(self, *args, **kwargs):
        raise TypeError("FrozenPeers is immutable")

    __setitem__ = __delitem__ = __ior__ = _immutable
    update = pop = popitem = clear = setdefault = _immutable


class _LinkTerms:
    """``FrozenPeers.terms`` for a plain mapping of links, computed per read."""

    __slots__ = ("links",)

    def __init__(self, links: Mapping[bytes, PeerLink]) -> None:
        self.links = links

    def __getitem__(self, peer: bytes) -> tuple[float | None, float]:
        link = self.links[peer]
        return link.load, link_cost_s(link)


class _AllBut:
    """The eligible peers as ``ids`` minus a few ``excluded`` ones (a subset of ``ids``),
    without copying ``ids``: what :meth:`Planner._eligible` returns for
    :class:`FrozenPeers`."""

    __slots__ = ("ids", "excluded")

    def __init__(self, ids: frozenset[bytes], excluded: frozenset[bytes]) -> None:
        self.ids = ids
        self.excluded = excluded

    def __contains__(self, peer: object) -> bool:
        return peer in self.ids and peer not in self.excluded

    def __len__(self) -> int:
        return len(self.ids) - len(self.excluded)

    def __iter__(self) -> Iterator[bytes]:
        excluded = self.excluded
        return (p for p in self.ids if p not in excluded)


@dataclass(frozen=True)
class PlanInput:
    """Everything a router knows when it decides on one request (values only)."""

    ns: bytes
    chain: tuple[bytes, ...]
    prompt_tokens: int
    local_matched_tokens: int
    local_prefill_tps: float  # this node's rate (its default while not measured)
    local_queue_wait_s: float
    local_load: float  # queued + running here
    avg_request_s: float  # this node's mean service time: a peer's queue wait = load x it
    hop_budget: int
    visited: frozenset[bytes]
    forwarded_in: bool  # a peer sent it (not a client)
    peers: Mapping[bytes, PeerLink]  # up peers this request may go to (tenant, not-serving)
    local_prefill_measured: bool = True  # False: use the candidates' median rate
    may_serve_here: bool = True
    carried: Mapping[bytes, int] | None = None  # the request's holder list (partitioned)
    answer: Mapping[bytes, int] | None = None  # a lookup answer just received
    may_look_up: bool = True  # entry node that has not looked up yet
    trust: Mapping[bytes, float] = field(default_factory=dict)  # .get(peer, 1.0)
    subnets: SubnetLimiter | None = None  # Sybil cap on candidates per subnet; None: off
    # the largest context among this node and the peers that said theirs: a prompt that
    # fits none of them is refused before routing; None: unknown (never refuse)
    context_tokens: int | None = None
    all_peers: tuple[bytes, ...] | None = None  # baselines' pool; None: the eligible peers


# ---------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Serve:
    reason: str
    decision: Decision
    ctx: RouteContext
    carry: tuple[tuple[bytes, int], ...] | None = None
    counters: tuple[str, ...] = ()
    targets: tuple[bytes, ...] = (LOCAL,)


@dataclass(frozen=True)
class Forward:
    reason: str
    targets: tuple[bytes, ...]  # in order; LOCAL (b"") = serve here
    decision: Decision
    ctx: RouteContext
    carry: tuple[tuple[bytes, int], ...] | None = None  # None: leave the request's as it is
    counters: tuple[str, ...] = ()

    @property
    def peer(self) -> bytes:
        return self.targets[0]


@dataclass(frozen=True)
class LookUp:
    reason: str
    homes: tuple[bytes, ...]  # ask in turn until one answers
    counters: tuple[str, ...] = ()


@dataclass(frozen=True)
class Reject:
    code: str  # a wire.ERROR_CODES code
    reason: str
    counters: tuple[str, ...] = ()


Plan = Serve | Forward | LookUp | Reject

_SOURCE_COUNTERS = {
    "home": "partition_home_decisions",
    "carried": "partition_carried_decisions",
    "cache": "partition_lookup_cache_hits",
}


_blocks_of_item = operator.itemgetter(1)


def carry_list(known: Mapping[bytes, int]) -> tuple[tuple[bytes, int], ...]:
    """A holder list as it rides on a forwarded request: longest matches first, within the
    wire limit, zero matches dropped."""
    # by (-blocks, peer): by peer, then a stable sort by blocks, longest first (C-speed
    # compares instead of a key tuple per holder)
    ranked = sorted(known.items())
    ranked.sort(key=_blocks_of_item, reverse=True)
    return tuple((p, b) for p, b in ranked[:MAX_CARRIED_HOLDERS] if b > 0)


def _sorted_pool(peers: Mapping[bytes, PeerLink],
                 eligible: Collection[bytes]) -> tuple[bytes, ...]:
    """``tuple(sorted(eligible))``; from a :class:`FrozenPeers`' sorted ids when only a
    few peers are left out (``eligible`` is a subset of ``peers``)."""
    if isinstance(peers, FrozenPeers) and len(peers) - len(eligible) <= 16:
        left_out = (eligible.excluded if isinstance(eligible, _AllBut)
                    else peers.ids.difference(eligible))  # fmt: skip
        pools = peers._pools
        pool = pools.pop(left_out, None)  # re-inserted below: least recently used first
        if pool is None:
            ids = peers.sorted_ids
            out = list(ids)
            for p in sorted(left_out, reverse=True):
                del out[bisect.bisect_left(ids, p)]
            pool = tuple(out)
            if len(pools) >= _POOLS_KEPT:
                del pools[next(iter(pools))]
        pools[left_out] = pool
        return pool
    return tuple(sorted(eligible))


# ---------------------------------------------------------------------------- planner


class Planner:
    """One router's planner: its policy, its memory, its cache view."""

    def __init__(self, me: bytes, policy: Policy, view: CacheView,
                 memory: RouterMemory | None = None, rng: random.Random | None = None) -> None:
        self.me = me
        self.policy = policy
        self.view = view
        self.memory = memory if memory is not None else RouterMemory.for_policy(policy, me)
        self.rng = rng if rng is not None else random.Random(0)  # draws the shed candidates

    def plan(self, inp: PlanInput, now: float) -> Plan:
        """What to do with one request (see the module docstring)."""
        if inp.context_tokens is not None and inp.prompt_tokens >= inp.context_tokens:
            return Reject("context_length_exceeded",
                          f"prompt of {inp.prompt_tokens} tokens does not fit the context of "
                          f"{inp.context_tokens} tokens")
        counters: list[str] = []
        matches, carry, lookup = self._matches(inp, now, counters)
        if lookup is not None:
            return lookup
        eligible = self._eligible(inp)
        candidates = self._candidates(inp, matches, eligible, counters)
        local_tps = inp.local_prefill_tps
        if not inp.local_prefill_measured:
            # not measured here yet: a default would make the comparison with peers'
            # measured rates unfair either way; same model, so use theirs (median)
            rates = sorted(c.prefill_tps for c in candidates if c.prefill_tps > 0)
            if rates:
                local_tps = rates[len(rates) // 2]
        pool = _sorted_pool(inp.peers, eligible) if inp.all_peers is None else inp.all_peers
        ctx, decision = self.memory.decide(
            self.policy, now=now, chain=inp.chain, prompt_tokens=inp.prompt_tokens,
            local_matched_tokens=min(inp.local_matched_tokens, inp.prompt_tokens),
            local_prefill_tps=max(local_tps, 1.0), local_queue_wait_s=inp.local_queue_wait_s,
            local_load=inp.local_load, candidates=candidates, hop_budget=inp.hop_budget,
            visited=inp.visited | {self.me}, all_peers=pool, n_nodes=len(eligible) + 1,
            forwarded_in=inp.forwarded_in,
        )  # fmt: skip
        return self._action(inp, ctx, decision, carry, tuple(counters))

    def _matches(self, inp: PlanInput, now: float, counters: list[str]):
        """(holder -> blocks, carry, LookUp or None) from the cache view."""
        carried = inp.answer if inp.answer is not None else (inp.carried or None)
        got = self.view.known(inp.ns, inp.chain, now, carried)
        if inp.answer is not None:
            got = ViewAnswer(got.matches, got.homes, "answer")
        if got.source in _SOURCE_COUNTERS:
            counters.append(_SOURCE_COUNTERS[got.source])
        if got.matches is not None:
            carry = None if got.source in ("index", "home", "none") else carry_list(got.matches)
            return got.matches, carry, None
        if not inp.may_look_up or self.policy.name in CACHE_BLIND_POLICIES:
            return {}, None, None
        live = [h for h in got.homes if h in inp.peers]
        if not live:
            counters.append("partition_no_live_home")
            return {}, None, None
        # what a hit elsewhere could save at most: prefilling what we do not hold
        unmatched = inp.prompt_tokens - min(inp.local_matched_tokens, inp.prompt_tokens)
        if not lookup_pays(unmatched, inp.local_prefill_tps, link_cost_s(inp.peers[live[0]])):
            counters.append("partition_lookups_skipped")
            return {}, None, None
        homes = tuple(live[:LOOKUP_HOMES])
        return {}, None, LookUp("partition lookup", homes, tuple(counters))

    def _eligible(self, inp: PlanInput) -> Collection[bytes]:
        visited, me, vouches = inp.visited, self.me, self.view.vouches
        peers = inp.peers
        if isinstance(peers, FrozenPeers) and getattr(self.view, "vouches_all", False):
            # the same set, from the cached id set (set operations, no per-peer calls)
            unfit = [p for p, ctx in peers.limited if not fits_context(inp.prompt_tokens, ctx)]
            return _AllBut(peers.ids, peers.ids.intersection({me, *visited, *unfit}))
        return {p for p, link in inp.peers.items() if p != me and p not in visited
                and vouches(p) and fits_context(inp.prompt_tokens, link.context_tokens)}

    def _priced(self, inp: PlanInput, peers: Iterable[bytes],
                matches: Mapping[bytes, int]) -> list[Candidate]:
        """A candidate for each peer (its blocks in ``matches``, else 0) that can be priced:
        its load from a PONG, else its digest's (queued + running); a peer with neither is
        left out.
        (Runs for every holder of every request: locals bound, one loop.)"""
        links = inp.peers
        terms = links.terms if type(links) is FrozenPeers else _LinkTerms(links)
        load_of = self.view.load_of
        # no trust figures at all (a plain empty dict): every peer's trust is 1.0
        trust = None if type(inp.trust) is dict and not inp.trust else inp.trust.get
        prompt_tokens, avg_request_s = inp.prompt_tokens, inp.avg_request_s
        out: list[Candidate] = []
        append = out.append
        blocks_of = matches.get
        for peer in peers:
            load, rtt = terms[peer]
            figures = load_of(peer)
            if load is None:
                if figures is None:
                    continue  # nothing to price it with
                load = float(figures.queue_depth + figures.active)
            append(make_candidate(
                peer,
                min(blocks_of(peer, 0) * BLOCK_TOKENS, prompt_tokens),
                max(figures.prefill_tps, 0.0) if figures is not None else 0.0,
                load * avg_request_s,
                load,
                rtt,
                1.0 if trust is None else min(1.0, max(0.0, trust(peer, 1.0))),
            ))  # fmt: skip
        return out

    def _candidates(self, inp: PlanInput, matches: Mapping[bytes, int],
                    eligible: Collection[bytes], counters: list[str]) -> list[Candidate]:
        if isinstance(eligible, _AllBut):  # the same peers, by set operations
            holders = eligible.ids.intersection(matches).difference(eligible.excluded)
        else:
            holders = (p for p in matches if p in eligible)
        out = self._priced(inp, sorted(holders), matches)
        # a few unmatched peers, drawn at random, let the policy shed load (the power of
        # two choices: the cost model picks the lighter; "least loaded first" herds every
        # router onto the same peers while load figures are seconds old)
        pool = self._shed_pool(inp, matches, eligible)
        drawn = self.rng.sample(pool, min(MAX_SHED_CANDIDATES, len(pool)))
        shed = self._priced(inp, drawn, matches)  # unmatched: 0 blocks each
        assert len(shed) == len(drawn)  # the pool holds priced peers only
        out += shed
        if inp.subnets is not None and out:
            # Sybil basics: many identities behind one subnet count as few candidates;
            # the most trusted, longest claims of each subnet are kept
            ranked = sorted(out, key=lambda c: (-c.trust, -c.matched_tokens, c.peer))
            kept = inp.subnets.select((c, inp.peers[c.peer].addrs) for c in ranked)
            if len(kept) < len(out):
                counters.extend(["subnet_limited"] * (len(out) - len(kept)))
                keep = {c.peer for c in kept}
                out = [c for c in out if c.peer in keep]
        return out

    def _shed_pool(self, inp: PlanInput, matches: Mapping[bytes, int],
                   eligible: Collection[bytes]) -> list[bytes]:
        """The eligible, unmatched peers that can be priced (a PONG load or a digest's
        figures, as in ``_priced``), sorted."""
        peers = inp.peers
        priced = getattr(self.view, "priced_peers", None)
        if isinstance(peers, FrozenPeers) and priced is not None:
            # _priced prices exactly the peers with a PONG figure or a digest figure
            pool = set(priced())
            pool |= peers.loaded
            pool &= peers.ids
            if isinstance(eligible, _AllBut):
                pool -= eligible.excluded
            else:
                pool &= eligible
            pool.difference_update(matches)
            if len(pool) * 16 < len(peers.sorted_ids):
                return sorted(pool)
            # sorted: the table's sorted ids filtered (C speed) instead of a sort per plan
            return list(filter(pool.__contains__, peers.sorted_ids))
        load_of = self.view.load_of
        return sorted(p for p in eligible if p not in matches
                      and (peers[p].load is not None or load_of(p) is not None))

    def _action(self, inp: PlanInput, ctx: RouteContext, decision: Decision, carry,
                counters: tuple[str, ...]) -> Plan:
        targets: list[bytes] = []
        if decision.action == FORWARD and decision.peer is not None:
            targets = [decision.peer, *decision.fallbacks]
        if inp.may_serve_here:
            if not targets:
                return Serve(decision.reason, decision, ctx, carry, counters)
            targets.append(LOCAL)
        elif inp.hop_budget > 0:
            # this node may not serve the namespace (allowed_peers): pass it on to the
            # candidates that may, longest estimated match first
            ranked = sorted(ctx.candidates, key=lambda c: (-c.matched_tokens, c.load, c.peer))
            targets += [c.peer for c in ranked if c.peer not in targets][:4]
        if not targets:
            return Reject("no_route", "no node may serve this request", counters)
        return Forward(decision.reason, tuple(targets), decision, ctx, carry, counters)
