"""Routing policy: serve a request locally or forward it to one peer, with an explanation.

Both the real node and the simulator (``bench/``) build a ``RouteContext`` (what this
node knows about the request, itself and its candidate peers) and ask a ``Policy`` for a
``Decision``. Policies are deterministic: randomness comes from the ``random.Random``
given to ``make_policy`` and is drawn only to break exact ties (``prefixmesh``,
``paper``, ``oracle``) or to pick a target (``random``).

Policies (``make_policy(name, ...)``)
    ``prefixmesh`` (ours). Cost model, in seconds::

        local  = (prompt - local_matched) / local_prefill_tps + local_queue_wait
        peer X = (prompt - matched_X * trust_X) / prefill_tps_X + queue_wait_X + rtt_X

    Forward to the cheapest eligible peer only when ``local - peer > margin_s +
    margin_frac * local``: the saving must beat the network hop's cost by a margin, so
    estimate noise does not make requests bounce. Eligible means: not visited, not
    this node, ``trust >= trust_floor``, and within the *bounded-load* limit (see
    ``load_bound``): a peer advertising the longest match is not eligible once it
    carries more than ``(1 + load_epsilon)`` times its fair share of the load. This
    is what fixes the reference paper's hot-node problem (its longest-match rule sends
    2.3-2.6x more traffic to the nodes holding popular prefixes). Nothing is forwarded
    when ``hop_budget <= 0``. A peer with no cache gain can still win when this node's
    queue wait dominates; callers that want such load shedding should include a few
    lightly-loaded peers among the candidates even when they match nothing.
    The baselines below live in ``bench/policies.py`` (simulator and benchmarks only).
    ``paper``: the reference paper's rule (arXiv:2606.17059): the longest estimated
    match wins, ties go to local; no load, latency or trust awareness.
    ``round-robin``: a per-instance counter over ``[self] + pool``. ``random``: a
    uniform pick from ``[self] + pool``. ``consistent-hash``: rendezvous (highest
    random weight) hashing of ``first_block`` over ``[self] + pool``; serves locally
    when the request has no whole block. The pool is ``ctx.all_peers`` (or, when that
    is empty, the candidates' peers), minus this node, sorted by id.
    ``local``: always serve. ``oracle``: given exact candidate information by a
    centralised caller (the simulator), minimise the cost model with no margin, no
    trust discount and no load bound (queue waits already price load); the upper
    reference, not a deployable policy.
    Every policy that picks a peer still respects ``visited`` and ``hop_budget``:
    when its pick is not allowed it serves locally and says so.

Ski rental (``RoutingConfig.ski_rental``, on by default; ``prefixmesh`` only)
    The cost model is myopic: forwarding a miss to the holder of a long prefix saves
    prefill once, but this node then never caches that prefix and every later request
    for it pays the hop again. Forwarding is *renting* (one RTT per forward), serving
    the miss here is *buying* (``local - (peer - rtt)``: the extra prefill of one
    local miss; afterwards the prefix is cached here). The node keeps the rent it has
    paid per prefix in a ``RentLedger`` and passes it as ``RouteContext.rent_paid_s``;
    the policy serves locally (buys) once ``rent_paid_s + rtt >= buy`` - the classic
    2-competitive break-even rule. Only cache-driven forwards (the chosen peer claims a
    longer match than local) rent. With ``rent_paid_s == 0`` it never changes a
    decision (a paying forward has ``buy > rtt``).

Smoothed load (``RoutingConfig.bound_placements``, on by default; ``prefixmesh`` only)
    Advertised queue depths are almost always 0 or 1 at the utilisation where caches
    pay, so the instantaneous bound is vacuous and Zipf-hot prefixes pile onto their
    holders. The digest's ``LoadFigures`` stay as they are; instead each router keeps a
    ``PlacementLedger``: exponentially decayed counts (time constant
    ``placement_tau_s``, 30 s) of the requests it placed at each node (itself
    included) and of the requests peers forwarded to it. The caller passes them as
    ``Candidate.recent_placed``, ``RouteContext.recent_placed_total``,
    ``.recent_placed_local``, ``.recent_forwarded_in`` and ``.n_nodes`` (nodes in
    view, this one included; 0 disables both rules). Two rules use them:

    - *placement bound* (``placement_bound``): a candidate is eligible only while this
      router's recent placements at it are at most ``max(ceil((1+eps) * (total+1) /
      n) - 1, (total+1) / n + placement_slack)``: one router alone cannot pile its
      traffic onto a holder.
    - *shedding* (``is_hot``): with clients spread over the nodes every node forwards
      out about the swarm's mean number of forwards, so a node whose peers forward it
      more than ``(1+eps)`` x what it forwards out, plus ``placement_slack``, holds
      something hot. A hot node forwards to any eligible peer whose estimate is no
      worse than local by more than ``margin_s`` (the absolute margin only, so a
      high-RTT hop never qualifies); its holders' replicas then share the load.

Load slack (``RoutingConfig.load_slack``)
    In small swarms the whole-request rounding of the bounded-load rule bites: with
    loads (0, 1, 0) its bound is 0 and a peer with one running request is excluded
    however long its cached prefix. A peer is never excluded while its load is at most
    ``mean load + load_slack`` (default 1 request); see ``load_bound``.

Load units
    ``load`` figures must be in requests (queued + running), so that one request adds
    one unit; the bounded-load limit rounds to whole requests.

Fallbacks
    A forwarding decision lists up to ``max_fallbacks`` further peers, in the order to
    try them if the chosen hop fails; they exclude the chosen peer, this node and
    visited peers. For ``prefixmesh`` and ``oracle`` every fallback also beats serving
    locally under the same rule as the choice; ``paper`` lists the other peers with a
    longer match than local; ``consistent-hash`` lists the next peers in rendezvous
    order ranked above this node; ``round-robin`` and ``random`` list none. When the
    fallbacks are exhausted the node serves locally.

Pure code: no trio, libp2p or llama imports.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

__all__ = [
    "DEPLOYABLE_POLICIES",
    "FORWARD",
    "POLICY_NAMES",
    "SERVE",
    "Candidate",
    "Decision",
    "InvalidRouteContext",
    "InvalidRoutingConfig",
    "DEFAULT_LEDGER_ENTRIES",
    "DEFAULT_PLACEMENT_TAU_S",
    "DEFAULT_RENT_MAX_AGE_S",
    "PlacementLedger",
    "Policy",
    "RentLedger",
    "RouterMemory",
    "RouteContext",
    "RoutingConfig",
    "RoutingError",
    "UnknownPolicy",
    "candidate_cost_s",
    "load_bound",
    "local_cost_s",
    "is_hot",
    "make_candidate",
    "make_policy",
    "peer_label",
    "rendezvous_score",
    "rent_key",
    "placement_bound",
]

SERVE = "serve"
FORWARD = "forward"
#: what a node may run (node/config.py validates [routing] policy against it); the
#: baselines (paper, round-robin, random, consistent-hash, oracle) live with the simulator
#: in bench/policies.py
DEPLOYABLE_POLICIES = ("prefixmesh", "local")
POLICY_NAMES = DEPLOYABLE_POLICIES  # what make_policy here builds


class RoutingError(ValueError):
    """Base class of every error raised by the routing module."""


class InvalidRoutingConfig(RoutingError):
    """A ``RoutingConfig`` field is out of its documented range."""


class InvalidRouteContext(RoutingError):
    """A ``RouteContext`` or ``Candidate`` carries an impossible value."""


class UnknownPolicy(RoutingError):
    """``make_policy`` was asked for a name not in ``POLICY_NAMES``."""


_INF = math.inf


def _finite_nonneg(value: float, what: str, exc: type[RoutingError]) -> None:
    t = type(value)
    if (t is float or t is int) and 0 <= value < _INF:  # the common case, checked cheaply
        return  # (NaN fails the comparison and takes the general check below)
    if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
        raise exc(f"{what} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class RoutingConfig:
    """Tunables of the ``prefixmesh`` policy (the baselines use only ``max_fallbacks``).

    load_epsilon: bounded-load slack; a candidate may carry up to ``1 + load_epsilon``
        times the mean load (counting the request being placed). 0.25 as in Mirrokni
        et al.'s consistent hashing with bounded loads.
    margin_s, margin_frac: forward only if the estimated saving exceeds
        ``margin_s + margin_frac * est_local_s`` (50 ms + 10 % of the local estimate).
    trust_floor: candidates with ``trust`` below it are ignored.
    max_fallbacks: how many further peers a forwarding decision lists.
    ski_rental: serve a prefix locally once the rent paid forwarding it reaches the
        cost of one local miss (see the module docstring).
    load_slack: a candidate is never excluded by the load bound while its load is at
        most the mean load + ``load_slack`` requests (small-swarm rounding).
    bound_placements: apply the bounded-load rule to this router's smoothed placements.
    placement_slack: like ``load_slack`` for the placement bound (decayed requests).
    placement_tau_s: the decay time constant callers give their ``PlacementLedger``.
    """

    load_epsilon: float = 0.25
    margin_s: float = 0.05
    margin_frac: float = 0.10
    trust_floor: float = 0.2
    max_fallbacks: int = 3
    ski_rental: bool = True
    load_slack: float = 1.0
    bound_placements: bool = True
    placement_slack: float = 1.0
    placement_tau_s: float = 30.0

    def __post_init__(self) -> None:
        _finite_nonneg(self.load_epsilon, "load_epsilon", InvalidRoutingConfig)
        _finite_nonneg(self.margin_s, "margin_s", InvalidRoutingConfig)
        _finite_nonneg(self.margin_frac, "margin_frac", InvalidRoutingConfig)
        if self.margin_frac >= 1:
            raise InvalidRoutingConfig(
                f"margin_frac must be < 1 (a saving can never exceed the local cost), "
                f"got {self.margin_frac!r}"
            )
        _finite_nonneg(self.trust_floor, "trust_floor", InvalidRoutingConfig)
        if self.trust_floor > 1:
            raise InvalidRoutingConfig(f"trust_floor must be in [0, 1], got {self.trust_floor!r}")
        if not isinstance(self.max_fallbacks, int) or self.max_fallbacks < 0:
            raise InvalidRoutingConfig(
                f"max_fallbacks must be an int >= 0, got {self.max_fallbacks!r}"
            )
        for flag in ("ski_rental", "bound_placements"):
            if not isinstance(getattr(self, flag), bool):
                raise InvalidRoutingConfig(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        _finite_nonneg(self.load_slack, "load_slack", InvalidRoutingConfig)
        _finite_nonneg(self.placement_slack, "placement_slack", InvalidRoutingConfig)
        if not (math.isfinite(self.placement_tau_s) and self.placement_tau_s > 0):
            raise InvalidRoutingConfig(
                f"placement_tau_s must be a finite number > 0, got {self.placement_tau_s!r}"
            )


@dataclass(frozen=True)
class Candidate:
    """One peer the request could go to, as this node estimates it.

    matched_tokens: the peer's estimated cached prefix of this prompt (tokens).
    prefill_tps: the peer's prefill rate; 0 means unknown, and the local rate is used.
    load: requests queued + running at the peer. trust in [0, 1].
    recent_placed: this router's decayed count of requests recently placed at the
        peer (``PlacementLedger.recent``); 0 when the caller keeps no ledger.
    """

    peer: bytes
    matched_tokens: int
    prefill_tps: float
    queue_wait_s: float
    load: float
    rtt_s: float
    trust: float = 1.0
    recent_placed: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.peer, bytes):
            raise InvalidRouteContext(f"candidate peer must be bytes, got {type(self.peer)}")
        if not isinstance(self.matched_tokens, int) or self.matched_tokens < 0:
            raise InvalidRouteContext(
                f"candidate matched_tokens must be an int >= 0, got {self.matched_tokens!r}"
            )
        _finite_nonneg(self.prefill_tps, "candidate prefill_tps", InvalidRouteContext)
        _finite_nonneg(self.queue_wait_s, "candidate queue_wait_s", InvalidRouteContext)
        _finite_nonneg(self.load, "candidate load", InvalidRouteContext)
        _finite_nonneg(self.rtt_s, "candidate rtt_s", InvalidRouteContext)
        _finite_nonneg(self.trust, "candidate trust", InvalidRouteContext)
        if self.trust > 1:
            raise InvalidRouteContext(f"candidate trust must be in [0, 1], got {self.trust!r}")
        _finite_nonneg(self.recent_placed, "candidate recent_placed", InvalidRouteContext)


_new_object = object.__new__
_set_attr = object.__setattr__  # a frozen dataclass refuses its own __setattr__


def make_candidate(peer: bytes, matched_tokens: int, prefill_tps: float, queue_wait_s: float,
                   load: float, rtt_s: float, trust: float = 1.0) -> Candidate:
    """``Candidate(...)`` for hot loops (the planner builds one per holder and request):
    the usual values (bytes, an int, floats in range) are checked inline and the object
    is built without the dataclass machinery; anything else goes through the validating
    constructor, so a bad value raises exactly its error."""
    if (type(peer) is bytes and type(matched_tokens) is int and matched_tokens >= 0
            and type(prefill_tps) is float and 0.0 <= prefill_tps < _INF
            and type(queue_wait_s) is float and 0.0 <= queue_wait_s < _INF
            and type(load) is float and 0.0 <= load < _INF
            and type(rtt_s) is float and 0.0 <= rtt_s < _INF
            and type(trust) is float and 0.0 <= trust <= 1.0):  # fmt: skip
        c = _new_object(Candidate)
        _set_attr(c, "__dict__", {
            "peer": peer, "matched_tokens": matched_tokens, "prefill_tps": prefill_tps,
            "queue_wait_s": queue_wait_s, "load": load, "rtt_s": rtt_s, "trust": trust,
            "recent_placed": 0.0,
        })  # fmt: skip
        return c
    return Candidate(peer, matched_tokens, prefill_tps, queue_wait_s, load, rtt_s, trust)


def _is_plus_zero(value: object) -> bool:
    return type(value) is float and value == 0.0 and math.copysign(1.0, value) == 1.0


def _with_recent_placed(c: Candidate, value: float) -> Candidate:
    """``replace(c, recent_placed=value)`` without re-validating the fields ``c`` already
    passed (the simulator builds millions of these; only the new value is checked)."""
    _finite_nonneg(value, "candidate recent_placed", InvalidRouteContext)
    old = c.recent_placed
    if (type(old) is float and type(value) is float and old == value
            and math.copysign(1.0, old) == math.copysign(1.0, value)):
        return c  # the same value (most candidates: never placed at): no copy
    new = object.__new__(Candidate)
    fields = new.__dict__
    fields.update(c.__dict__)
    fields["recent_placed"] = value
    return new


@dataclass(frozen=True)
class RouteContext:
    """Everything a policy may look at for one request (validated on construction)."""

    prompt_tokens: int
    local_matched_tokens: int
    local_prefill_tps: float
    local_queue_wait_s: float
    local_load: float
    candidates: tuple[Candidate, ...]
    hop_budget: int  # forwards still allowed; <= 0 means serve here
    visited: frozenset[bytes]  # peers this request has already been through
    first_block: bytes | None  # h_1 of the request (consistent-hash); None if no block
    all_peers: tuple[bytes, ...] = ()  # every known peer (round-robin, random, c-hash)
    rent_paid_s: float = 0.0  # RTT already paid forwarding this prefix (RentLedger.paid)
    recent_placed_total: float = 0.0  # PlacementLedger.total: decayed placements, all nodes
    recent_placed_local: float = 0.0  # PlacementLedger.recent(self): requests served here
    recent_forwarded_in: float = 0.0  # PlacementLedger.inbound: requests peers sent here
    n_nodes: int = 0  # nodes the placements spread over, this one included; 0: no ledger

    def __post_init__(self) -> None:
        # Accept any iterable for the collection fields; store the immutable forms.
        object.__setattr__(self, "candidates", tuple(self.candidates))
        object.__setattr__(self, "visited", frozenset(self.visited))
        object.__setattr__(self, "all_peers", tuple(self.all_peers))
        if not isinstance(self.prompt_tokens, int) or self.prompt_tokens < 0:
            raise InvalidRouteContext(
                f"prompt_tokens must be an int >= 0, got {self.prompt_tokens!r}"
            )
        if not isinstance(self.local_matched_tokens, int) or not (
            0 <= self.local_matched_tokens <= self.prompt_tokens
        ):
            raise InvalidRouteContext(
                f"local_matched_tokens must be an int in [0, prompt_tokens="
                f"{self.prompt_tokens}], got {self.local_matched_tokens!r}"
            )
        _finite_nonneg(self.local_prefill_tps, "local_prefill_tps", InvalidRouteContext)
        if self.local_prefill_tps == 0:
            raise InvalidRouteContext("local_prefill_tps must be > 0")
        _finite_nonneg(self.local_queue_wait_s, "local_queue_wait_s", InvalidRouteContext)
        _finite_nonneg(self.local_load, "local_load", InvalidRouteContext)
        if not isinstance(self.hop_budget, int):
            raise InvalidRouteContext(f"hop_budget must be an int, got {self.hop_budget!r}")
        seen: set[bytes] = set()
        for c in self.candidates:
            if not isinstance(c, Candidate):
                raise InvalidRouteContext(f"candidates must be Candidate objects, got {c!r}")
            if c.peer in seen:
                raise InvalidRouteContext(f"candidate {peer_label(c.peer)} listed twice")
            seen.add(c.peer)
        if self.first_block is not None and not isinstance(self.first_block, bytes):
            raise InvalidRouteContext("first_block must be bytes or None")
        _finite_nonneg(self.rent_paid_s, "rent_paid_s", InvalidRouteContext)
        _finite_nonneg(self.recent_placed_total, "recent_placed_total", InvalidRouteContext)
        _finite_nonneg(self.recent_placed_local, "recent_placed_local", InvalidRouteContext)
        _finite_nonneg(self.recent_forwarded_in, "recent_forwarded_in", InvalidRouteContext)
        if not isinstance(self.n_nodes, int) or self.n_nodes < 0:
            raise InvalidRouteContext(f"n_nodes must be an int >= 0, got {self.n_nodes!r}")


@dataclass(frozen=True)
class Decision:
    """What to do with one request, and why (``reason`` goes into route traces)."""

    action: str  # SERVE | FORWARD
    peer: bytes | None  # the peer to forward to; None when serving
    reason: str
    est_local_s: float  # cost model's estimate of serving here
    est_peer_s: float | None  # ... of the chosen peer; None when serving
    fallbacks: tuple[bytes, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.action == SERVE:
            if self.peer is not None or self.fallbacks:
                raise RoutingError("a serve decision names no peer and no fallbacks")
        elif self.action == FORWARD:
            if self.peer is None:
                raise RoutingError("a forward decision must name a peer")
            if self.peer in self.fallbacks:
                raise RoutingError("the chosen peer cannot also be a fallback")
        else:
            raise RoutingError(f"decision action must be {SERVE!r} or {FORWARD!r}")


@runtime_checkable
class Policy(Protocol):
    name: str

    def decide(self, ctx: RouteContext) -> Decision: ...


# ---------------------------------------------------------------------------- cost model


def peer_label(peer: bytes) -> str:
    """A short, readable name for a peer in reasons (the id's last 4 bytes in hex).

    The tail is used because libp2p Ed25519 peer ids share their first 6 bytes.
    """
    return peer[-4:].hex() if peer else "self"


def local_cost_s(ctx: RouteContext) -> float:
    """Estimated seconds until this node finishes prefilling the request."""
    uncached = ctx.prompt_tokens - ctx.local_matched_tokens
    return uncached / ctx.local_prefill_tps + ctx.local_queue_wait_s


def candidate_cost_s(ctx: RouteContext, c: Candidate, *, use_trust: bool = True) -> float:
    """Estimated seconds until peer ``c`` finishes prefilling the request, hop included.

    With ``use_trust`` the claimed match is discounted to ``matched * trust``.
    """
    matched = min(c.matched_tokens, ctx.prompt_tokens)
    if use_trust:
        matched = matched * c.trust
    tps = c.prefill_tps if c.prefill_tps > 0 else ctx.local_prefill_tps
    return (ctx.prompt_tokens - matched) / tps + c.queue_wait_s + c.rtt_s


def load_bound(ctx: RouteContext, epsilon: float, slack: float = 0.0) -> float:
    """The highest load an eligible ``prefixmesh`` candidate may carry.

    Bounded loads in the form of Mirrokni, Thorup and Zadimoghaddam: over the ``n``
    nodes in view (this node and every candidate), the mean load *counting the request
    being placed* is ``m = (sum of loads + 1) / n``; a node may take the request only
    if it then stays within ``ceil((1 + epsilon) * m)`` whole requests, i.e. its load
    is at most that minus one. Counting the request and rounding up keep the rule
    from refusing every busy peer in a mostly idle cluster (with loads 0 and 1 the
    plain ``(1+eps) * mean`` bound would refuse a peer carrying a single request).
    With ``slack > 0`` the bound is at least ``mean load + slack`` (the mean without
    the request): in a 3-node swarm with loads (0, 1, 0) the rounded bound is 0, and a
    slack of 1 keeps the peer with one request (and perhaps the longest match)
    eligible.
    """
    loads = [ctx.local_load] + [c.load for c in ctx.candidates]
    mean_with_request = (sum(loads) + 1.0) / len(loads)
    # The small tolerance keeps float noise (1.25 * 4.0 == 5.000000000001) from
    # granting an extra whole request.
    bound = math.ceil((1.0 + epsilon) * mean_with_request - 1e-9) - 1.0
    if slack > 0:
        bound = max(bound, sum(loads) / len(loads) + slack)
    return bound


def placement_bound(ctx: RouteContext, epsilon: float, slack: float = 0.0) -> float:
    """The most recent placements an eligible candidate may have (``inf``: no ledger).

    The bounded-load rule applied to this router's decayed placement counts over
    ``ctx.n_nodes`` nodes: ``max(ceil((1 + eps) * (total + 1) / n) - 1,
    (total + 1) / n + slack)``. See "Smoothed load" in the module docstring.
    """
    if ctx.n_nodes <= 0:
        return math.inf
    mean_with_request = (ctx.recent_placed_total + 1.0) / ctx.n_nodes
    bound = math.ceil((1.0 + epsilon) * mean_with_request - 1e-9) - 1.0
    return max(bound, mean_with_request + slack)


def is_hot(ctx: RouteContext, epsilon: float, slack: float = 0.0) -> bool:
    """Whether this node receives clearly more forwarded requests than it sends out.

    With clients spread over the nodes, every node forwards out about the mean number
    of forwards the swarm makes, so a node whose peers send it more than ``(1 + eps)``
    times what it sends out (plus ``slack``) holds something hot and should shed.
    Always False without a ledger (``n_nodes == 0``).
    """
    if ctx.n_nodes <= 0:
        return False
    sent_out = max(0.0, ctx.recent_placed_total - ctx.recent_placed_local)
    return ctx.recent_forwarded_in > (1.0 + epsilon) * sent_out + slack


def rent_key(
    chain: Sequence[bytes], candidates: Iterable[Candidate], block_tokens: int = 16
) -> bytes | None:
    """The ledger key of a request's rent: the chain hash at the deepest whole block any
    candidate claims (capped at the chain's length); None when none claims a block.

    Keying by the claimed prefix (not by the first block, which many different
    prompts share) charges rent to the cache entry that forwarding would reuse.
    """
    deepest = max((c.matched_tokens // block_tokens for c in candidates), default=0)
    deepest = min(deepest, len(chain))
    return chain[deepest - 1] if deepest > 0 else None


# ---------------------------------------------------------------------------- ledgers

DEFAULT_LEDGER_ENTRIES = 4096
DEFAULT_RENT_MAX_AGE_S = 600.0
DEFAULT_PLACEMENT_TAU_S = 30.0


class RentLedger:
    """Ski-rental rent per prefix key: seconds of RTT paid forwarding it (pure, bounded).

    At most ``max_entries`` keys (least recently touched dropped first, O(1) each); a
    key not touched for ``max_age_s`` reads as 0 (demand that old says little about
    the next request). Typical use per routing decision::

        key = rent_key(chain, candidates)
        ctx = RouteContext(..., rent_paid_s=ledger.paid(key, now))
        decision = policy.decide(ctx)
        ledger.observe(key, ctx, decision, now)

    ``observe`` pays the chosen peer's RTT for a cache-driven forward (the peer claims
    more than the local match) and clears the key when the request is served here:
    the prefix is then cached locally (bought); if it is evicted later, renting starts
    again from zero.
    """

    def __init__(
        self, max_entries: int = DEFAULT_LEDGER_ENTRIES, max_age_s: float = DEFAULT_RENT_MAX_AGE_S
    ) -> None:
        if not isinstance(max_entries, int) or max_entries < 1:
            raise RoutingError(f"max_entries must be an int >= 1, got {max_entries!r}")
        _finite_nonneg(max_age_s, "max_age_s", RoutingError)
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        self._rent: OrderedDict[bytes, tuple[float, float]] = OrderedDict()  # key -> (s, at)

    def __len__(self) -> int:
        return len(self._rent)

    def paid(self, key: bytes | None, now: float) -> float:
        """Rent paid for ``key`` so far (0 for None, unknown or stale keys)."""
        if key is None:
            return 0.0
        got = self._rent.get(key)
        if got is None or now - got[1] > self.max_age_s:
            return 0.0
        return got[0]

    def pay(self, key: bytes, amount_s: float, now: float) -> float:
        """Add ``amount_s`` of rent to ``key``; returns the new total."""
        _finite_nonneg(amount_s, "rent amount", RoutingError)
        total = self.paid(key, now) + amount_s
        self._rent[key] = (total, now)
        self._rent.move_to_end(key)
        while len(self._rent) > self.max_entries:
            self._rent.popitem(last=False)
        return total

    def settle(self, key: bytes | None) -> None:
        """Forget ``key`` (the prefix was bought: served and cached here)."""
        if key is not None:
            self._rent.pop(key, None)

    def observe(self, key: bytes | None, ctx: RouteContext, decision: Decision, now: float) -> None:
        """Book one decision made with ``rent_paid_s = paid(key, now)``."""
        if key is None:
            return
        if decision.action == SERVE:
            self.settle(key)
            return
        c = next((c for c in ctx.candidates if c.peer == decision.peer), None)
        if c is not None and c.matched_tokens > ctx.local_matched_tokens:
            self.pay(key, c.rtt_s, now)


class PlacementLedger:
    """Exponentially decayed counts of the requests this router placed at each node.

    ``record(node, now)`` after every decision (the chosen peer, or this node's own id
    when serving) and ``record_inbound(now)`` for every request a peer forwarded here;
    ``recent(node, now)``, ``total(now)``, ``recent(self_id, now)`` and ``inbound(now)``
    feed ``Candidate.recent_placed``, ``RouteContext.recent_placed_total``,
    ``.recent_placed_local`` and ``.recent_forwarded_in``. A count
    decays by ``exp(-dt / tau_s)`` (default 30 s: about the last 30 s of placements),
    so the figures are request rates x ``tau_s``. At most ``max_entries`` nodes are
    tracked (least recently placed dropped first; their counts are tiny by then).
    Time must not run backwards (an earlier ``now`` is treated as no time passing).
    """

    def __init__(
        self, tau_s: float = DEFAULT_PLACEMENT_TAU_S, max_entries: int = DEFAULT_LEDGER_ENTRIES
    ) -> None:
        if not (isinstance(tau_s, int | float) and math.isfinite(tau_s) and tau_s > 0):
            raise RoutingError(f"tau_s must be a finite number > 0, got {tau_s!r}")
        if not isinstance(max_entries, int) or max_entries < 1:
            raise RoutingError(f"max_entries must be an int >= 1, got {max_entries!r}")
        self.tau_s = float(tau_s)
        self.max_entries = max_entries
        self._counts: OrderedDict[bytes, tuple[float, float]] = OrderedDict()  # node -> (n, at)
        self._total = (0.0, 0.0)
        self._inbound = (0.0, 0.0)

    def __len__(self) -> int:
        return len(self._counts)

    def _decayed(self, value: float, at: float, now: float) -> float:
        return value * math.exp(-max(0.0, now - at) / self.tau_s) if value else 0.0

    def recent(self, node: bytes, now: float) -> float:
        got = self._counts.get(node)
        return self._decayed(got[0], got[1], now) if got is not None else 0.0

    def total(self, now: float) -> float:
        return self._decayed(self._total[0], self._total[1], now)

    def inbound(self, now: float) -> float:
        """Decayed count of requests peers forwarded to this node."""
        return self._decayed(self._inbound[0], self._inbound[1], now)

    def record_inbound(self, now: float) -> None:
        """Count one request that a peer forwarded here (before deciding on it)."""
        at = max(now, self._inbound[1])
        self._inbound = (self.inbound(at) + 1.0, at)

    def record(self, node: bytes, now: float) -> None:
        at = max(now, self._total[1])
        self._counts[node] = (self.recent(node, at) + 1.0, at)
        self._counts.move_to_end(node)
        while len(self._counts) > self.max_entries:
            self._counts.popitem(last=False)
        self._total = (self.total(at) + 1.0, at)



class RouterMemory:
    """What one router remembers between decisions, and the one way to decide with it.

    The node (``overlay/infer.py``) and the simulator (``bench/sim.py``) both route
    through :meth:`decide`, so the call sequence below exists once:

    1. a request a peer forwarded here is counted (``PlacementLedger.record_inbound``)
       *before* deciding on it: it is what makes this node "hot" (shedding);
    2. every candidate gets ``recent_placed`` (this router's decayed placements there);
    3. the rent key is the chain hash at the deepest block any candidate claims, and
       the context carries the rent already paid for it plus the placement totals;
    4. after the policy decided, the rent ledger books the decision (pay one RTT for a
       cache-driven forward, settle on serving here) and the chosen node (or this one)
       is recorded as a placement.

    ``enabled=False`` (baseline policies, or a caller without ledgers) builds the same
    context with every ledger field 0, which switches the rules off.
    """

    def __init__(
        self,
        self_id: bytes,
        *,
        enabled: bool = True,
        placement_tau_s: float = DEFAULT_PLACEMENT_TAU_S,
        max_entries: int = DEFAULT_LEDGER_ENTRIES,
        block_tokens: int = 16,
    ) -> None:
        self.self_id = self_id
        self.enabled = enabled
        self.block_tokens = block_tokens
        self.rent = RentLedger(max_entries)
        self.placements = PlacementLedger(placement_tau_s, max_entries)

    @classmethod
    def for_policy(cls, policy: Policy, self_id: bytes) -> RouterMemory:
        """The memory a router running ``policy`` keeps: ledgers only for ``prefixmesh``
        (the baselines ignore them), decaying with its ``placement_tau_s``."""
        config = getattr(policy, "config", None)
        return cls(
            self_id,
            enabled=getattr(policy, "name", "") == PrefixMeshPolicy.name,
            placement_tau_s=getattr(config, "placement_tau_s", DEFAULT_PLACEMENT_TAU_S),
        )

    def context(
        self,
        *,
        now: float,
        chain: Sequence[bytes],
        prompt_tokens: int,
        local_matched_tokens: int,
        local_prefill_tps: float,
        local_queue_wait_s: float,
        local_load: float,
        candidates: Iterable[Candidate],
        hop_budget: int,
        visited: Iterable[bytes],
        all_peers: Iterable[bytes] = (),
        n_nodes: int = 0,
        forwarded_in: bool = False,
    ) -> tuple[RouteContext, bytes | None]:
        """Steps 1-3: the validated context and its rent key (None: nothing to rent).

        ``n_nodes``: nodes the placements spread over, this one included.
        ``forwarded_in``: the request came from a peer (not from a client).
        """
        candidates = tuple(candidates)
        key: bytes | None = None
        ledger: dict[str, float | int] = {}
        if self.enabled:
            if forwarded_in:
                self.placements.record_inbound(now)
            recent = self.placements.recent
            # a peer never placed at has recent() == +0.0, which _with_recent_placed
            # answers with c itself when c already holds +0.0: skip both calls then
            placed_at = self.placements._counts
            candidates = tuple([
                c if c.recent_placed or (c.peer not in placed_at and _is_plus_zero(c.recent_placed))
                else _with_recent_placed(c, recent(c.peer, now))
                for c in candidates
            ])  # fmt: skip
            key = rent_key(chain, candidates, self.block_tokens)
            ledger = {
                "rent_paid_s": self.rent.paid(key, now),
                "recent_placed_total": self.placements.total(now),
                "recent_placed_local": self.placements.recent(self.self_id, now),
                "recent_forwarded_in": self.placements.inbound(now),
                "n_nodes": n_nodes,
            }
        ctx = RouteContext(
            prompt_tokens=prompt_tokens,
            local_matched_tokens=local_matched_tokens,
            local_prefill_tps=local_prefill_tps,
            local_queue_wait_s=local_queue_wait_s,
            local_load=local_load,
            candidates=candidates,
            hop_budget=hop_budget,
            visited=visited,
            first_block=chain[0] if chain else None,
            all_peers=all_peers,
            **ledger,
        )
        return ctx, key

    def record(self, key: bytes | None, ctx: RouteContext, decision: Decision, now: float) -> None:
        """Step 4: book ``decision``, made on ``ctx`` (from :meth:`context`)."""
        if not self.enabled:
            return
        self.rent.observe(key, ctx, decision, now)
        self.placements.record(decision.peer or self.self_id, now)

    def decide(self, policy: Policy, *, now: float, **context) -> tuple[RouteContext, Decision]:
        """:meth:`context`, ``policy.decide``, :meth:`record`: one routing decision."""
        ctx, key = self.context(now=now, **context)
        decision = policy.decide(ctx)
        self.record(key, ctx, decision, now)
        return ctx, decision


def _same_cost(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12)


def _serve(reason: str, est_local_s: float) -> Decision:
    return Decision(SERVE, None, reason, est_local_s, None, ())


def _pool(ctx: RouteContext, self_id: bytes) -> list[bytes]:
    peers: Iterable[bytes] = ctx.all_peers or (c.peer for c in ctx.candidates)
    return sorted(set(peers) - {self_id})


def _break_top_tie(
    ranked: list[tuple[float, bytes]], rng: random.Random
) -> list[tuple[float, bytes]]:
    """``ranked`` sorted by (cost, peer): pick among exactly-tied best entries by rng."""
    best = ranked[0][0]
    n_tied = 1
    while n_tied < len(ranked) and _same_cost(ranked[n_tied][0], best):
        n_tied += 1
    if n_tied == 1:
        return ranked
    pick = rng.randrange(n_tied)
    return [ranked[pick]] + ranked[:pick] + ranked[pick + 1 :]


# ---------------------------------------------------------------------------- policies


class _PolicyBase:
    """What every policy is built from (``make_policy`` passes the same three)."""

    name = ""

    def __init__(self, config: RoutingConfig, rng: random.Random, self_id: bytes) -> None:
        self.config = config
        self.rng = rng
        self.self_id = self_id


class PrefixMeshPolicy(_PolicyBase):
    """Cost model with margin, bounded load and trust (see the module docstring)."""

    name = "prefixmesh"

    def _screen(self, ctx: RouteContext) -> tuple[list[tuple[float, bytes]], dict, str]:
        """The eligible candidates' (cost, peer), candidates by peer, and what was skipped."""
        cfg = self.config
        bound = load_bound(ctx, cfg.load_epsilon, cfg.load_slack)
        placed_bound = (
            placement_bound(ctx, cfg.load_epsilon, cfg.placement_slack)
            if cfg.bound_placements
            else math.inf
        )
        n_visited = n_untrusted = n_overloaded = n_hot = 0
        scored: list[tuple[float, bytes]] = []
        by_peer: dict[bytes, Candidate] = {}
        for c in ctx.candidates:
            if c.peer == self.self_id or c.peer in ctx.visited:
                n_visited += 1
            elif c.trust < cfg.trust_floor:
                n_untrusted += 1
            elif c.load > bound:
                n_overloaded += 1
            elif c.recent_placed > placed_bound:
                n_hot += 1
            else:
                scored.append((candidate_cost_s(ctx, c), c.peer))
                by_peer[c.peer] = c
        skipped = (
            f"{len(ctx.candidates)} candidates: {n_visited} visited, "
            f"{n_untrusted} under trust floor {cfg.trust_floor:g}, "
            f"{n_overloaded} over load bound {bound:g}"
            + (f", {n_hot} over placement bound {placed_bound:.2f}" if n_hot else "")
        )
        return scored, by_peer, skipped

    def decide(self, ctx: RouteContext) -> Decision:
        cfg = self.config
        local = local_cost_s(ctx)
        if ctx.hop_budget <= 0:
            return _serve(f"{self.name}: serve, hop budget exhausted", local)
        scored, by_peer, skipped = self._screen(ctx)
        required = cfg.margin_s + cfg.margin_frac * local
        # A hot node sheds: any eligible peer no worse than local by more than
        # ``margin_s`` will do (serving here is what is overloaded). Only the absolute
        # margin: a relative one would let high-RTT hops through.
        shedding = (
            is_hot(ctx, cfg.load_epsilon, cfg.placement_slack) if cfg.bound_placements else False
        )
        need = -cfg.margin_s if shedding else required
        paying = sorted((cost, p) for cost, p in scored if local - cost > need)
        if not paying:
            if scored:
                best_cost, best_peer = min(scored)
                best = (
                    f"best {peer_label(best_peer)} est {best_cost:.3f}s saves "
                    f"{local - best_cost:.3f}s < required {need:.3f}s"
                )
            else:
                best = "no eligible candidate"
            return _serve(f"{self.name}: serve, local est {local:.3f}s; {best}; {skipped}", local)
        ranked = _break_top_tie(paying, self.rng)
        cost, peer = ranked[0]
        c = by_peer[peer]
        # Ski rental prices cache-driven forwards that pay for themselves; a shedding
        # forward that does not pay is about load, not about renting a prefix.
        if (
            cfg.ski_rental
            and c.matched_tokens > ctx.local_matched_tokens
            and local - cost > required
        ):
            buy = local - (cost - c.rtt_s)
            rent = ctx.rent_paid_s + c.rtt_s
            if rent >= buy:
                return _serve(
                    f"{self.name}: serve (ski rental: rent {rent:.3f}s paid forwarding this "
                    f"prefix >= one local miss {buy:.3f}s; would forward to "
                    f"{peer_label(peer)} est {cost:.3f}s vs local {local:.3f}s)",
                    local,
                )
        fallbacks = tuple(p for _, p in ranked[1 : 1 + cfg.max_fallbacks])
        reason = self._forward_reason(ctx, c, cost, local, required, shedding, skipped,
                                      len(fallbacks))  # fmt: skip
        return Decision(FORWARD, peer, reason, local, cost, fallbacks)

    def _forward_reason(self, ctx: RouteContext, c: Candidate, cost: float, local: float,
                        required: float, shedding: bool, skipped: str, n_fallbacks: int) -> str:
        cfg = self.config
        why = (
            f"shedding: {ctx.recent_forwarded_in:.2f} recent requests in from peers vs "
            f"{ctx.recent_placed_total - ctx.recent_placed_local:.2f} out, loses "
            f"{cost - local:.3f}s < margin {cfg.margin_s:.3f}s; "
            if shedding
            else f"saves {local - cost:.3f}s > required {required:.3f}s; "
        )
        return (
            f"{self.name}: forward to {peer_label(c.peer)}, est {cost:.3f}s vs local "
            f"{local:.3f}s ({why}match {c.matched_tokens} tok x trust {c.trust:g} vs local "
            f"{ctx.local_matched_tokens} of {ctx.prompt_tokens}; queue {c.queue_wait_s:.3f}s, "
            f"rtt {c.rtt_s:.3f}s, load {c.load:g}); {skipped}; "
            f"{n_fallbacks} fallbacks"
        )

class LocalPolicy(_PolicyBase):
    name = "local"

    def decide(self, ctx: RouteContext) -> Decision:
        return _serve(f"{self.name}: always serve", local_cost_s(ctx))


def rendezvous_score(key: bytes, node: bytes) -> int:
    """Highest-random-weight score of ``node`` for ``key`` (stable across processes)."""
    digest = hashlib.blake2b(len(key).to_bytes(2, "little") + key + node, digest_size=8).digest()
    return int.from_bytes(digest, "big")


_POLICIES: dict[str, type] = {
    "prefixmesh": PrefixMeshPolicy,
    "local": LocalPolicy,
}


def make_policy(
    name: str,
    config: RoutingConfig | None = None,
    rng: random.Random | None = None,
    self_id: bytes = b"",
) -> Policy:
    """A fresh policy instance named ``name`` (one of ``POLICY_NAMES``).

    ``rng`` defaults to ``random.Random(0)`` so that a policy is deterministic even
    when the caller forgets to seed it; give each node its own seeded instance.
    """
    try:
        cls = _POLICIES[name]
    except KeyError:
        raise UnknownPolicy(
            f"unknown routing policy {name!r}; known: {', '.join(POLICY_NAMES)}"
        ) from None
    return cls(config or RoutingConfig(), rng if rng is not None else random.Random(0), self_id)
