"""Tests of overlay/core/limits.py: the forwarded-share cap, subnet caps for routing
candidates and inbound connections (the rate limiter: test_ratelimit.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.overlay.core.limits import (
    ForwardShareLimiter,
    InboundSubnetCap,
    SubnetLimiter,
    subnet_of_multiaddr,
)
from prefixmesh.overlay.core.routing import Candidate
from prefixmesh.overlay.core.trust import InvalidTrustConfig

# ---------------------------------------------------------------------------- share limiter


def test_share_limiter_validation():
    with pytest.raises(InvalidTrustConfig):
        ForwardShareLimiter(max_share=0)
    with pytest.raises(InvalidTrustConfig):
        ForwardShareLimiter(window=10, min_count=11)
    with pytest.raises(InvalidTrustConfig):
        ForwardShareLimiter(max_age_s=0)


def test_share_limiter_basic_cap():
    lim = ForwardShareLimiter(max_share=0.5, window=100, min_count=20)
    n = 0
    while lim.allowed(b"x", 0.0):
        lim.record(b"x", 0.0)
        n += 1
    assert n == 10  # 0.5 * min_count
    # other peers' forwards make room again
    for _ in range(10):
        assert lim.allowed(b"y", 0.0)
        lim.record(b"y", 0.0)
    assert lim.share(b"x") == 0.5
    assert not lim.allowed(b"x", 0.0)  # 11 of 21 would exceed 0.5
    lim.record(b"z", 0.0)
    assert lim.allowed(b"x", 0.0)  # 11 of 22
    kept = lim.filter([Candidate(b"x", 1, 1, 0, 0, 0), Candidate(b"y", 1, 1, 0, 0, 0)], 0.0)
    assert [c.peer for c in kept] == [b"x", b"y"]


def test_share_limiter_entries_age_out():
    lim = ForwardShareLimiter(max_share=0.5, window=100, min_count=20, max_age_s=60)
    for _ in range(10):
        lim.record(b"x", 0.0)
    assert not lim.allowed(b"x", 59.0)
    assert lim.allowed(b"x", 60.0)
    assert len(lim) == 0


@settings(max_examples=200, deadline=None)
@given(
    share=st.sampled_from([0.25, 0.5, 0.75]),
    window=st.integers(5, 60),
    min_frac=st.floats(0.1, 1.0),
    attempts=st.lists(st.integers(0, 4), min_size=1, max_size=300),
)
def test_share_limiter_never_exceeds_cap_in_any_window(share, window, min_frac, attempts):
    """Whatever order peers ask in (peer 0 is greedy: it is tried first every time), a peer
    never holds more than the cap of any window of the last `window` forwards once that
    window holds `min_count`, checked on the full history, independently of the class."""
    min_count = max(1, int(window * min_frac))
    lim = ForwardShareLimiter(max_share=share, window=window, min_count=min_count, max_age_s=1e9)
    history: list[bytes] = []
    for step, choice in enumerate(attempts):
        for peer in (b"greedy", bytes([choice])):
            if lim.allowed(peer, float(step)):
                lim.record(peer, float(step))
                history.append(peer)
                break
        last = history[-window:]
        for p in set(last):
            count = last.count(p)
            assert count <= share * max(len(last), min_count) + 1e-9
            if len(last) >= min_count:
                assert count / len(last) <= share + 1e-9



# ---------------------------------------------------------------------------- subnets


def test_subnet_of_multiaddr():
    assert subnet_of_multiaddr("/ip4/10.1.2.3/tcp/4001") == "10.1.2.0/24"
    assert subnet_of_multiaddr("/ip6/2001:db8:1:2::5/tcp/1") == "2001:db8:1::/48"
    assert subnet_of_multiaddr("/dns4/Node.Example.org./tcp/1") == "dns:node.example.org"
    assert subnet_of_multiaddr("/ip4/999.1.1.1/tcp/1") is None
    assert subnet_of_multiaddr("garbage") is None
    assert subnet_of_multiaddr(None) is None  # type: ignore[arg-type]


def test_subnet_limiter_caps_each_subnet():
    lim = SubnetLimiter(max_per_subnet=2)
    peers = [(f"a{i}", [f"/ip4/10.0.0.{i}/tcp/1"]) for i in range(5)]
    peers += [("b", ["/ip4/10.0.1.1/tcp/1"]), ("c", ["/ip6/2001:db8::1/tcp/1"])]
    peers += [
        ("lo1", ["/ip4/127.0.0.1/tcp/1"]),
        ("lo2", ["/ip4/127.0.0.1/tcp/2"]),
        ("lo3", ["/ip6/::1/tcp/3"]),
    ]
    peers += [("n1", []), ("n2", ["/unix/x"]), ("n3", [])]
    kept = lim.select(peers)
    assert kept == ["a0", "a1", "b", "c", "lo1", "lo2", "lo3", "n1", "n2"]
    # a peer announcing a full subnet among others is refused entirely
    assert lim.select(peers[:2] + [("multi", ["/ip4/10.0.0.9/tcp/1", "/ip4/10.9.9.9/tcp/1"])]) == [
        "a0",
        "a1",
    ]
    strict = SubnetLimiter(max_per_subnet=1, exempt_loopback=False)
    assert strict.select(peers[7:10]) == ["lo1", "lo3"]


@given(
    peers=st.lists(
        st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 255)), max_size=3),
        max_size=40,
    ),
    cap=st.integers(1, 4),
)
def test_subnet_limiter_property(peers, cap):
    lim = SubnetLimiter(max_per_subnet=cap)
    items = [
        (i, [f"/ip4/10.{a}.{b}.{c}/tcp/1" for a, b, c in addrs]) for i, addrs in enumerate(peers)
    ]
    kept = lim.select(items)
    assert kept == sorted(kept)  # preference order kept
    counts: dict[str, int] = {}
    for i in kept:
        for s in lim.subnets(items[i][1]):
            counts[s] = counts.get(s, 0) + 1
    assert all(v <= cap for v in counts.values())


_ADDRS = ["/ip4/10.0.0.1/tcp/1", "/ip4/10.0.0.9/tcp/2", "/ip4/10.0.1.5/tcp/3",
          "/ip6/2001:db8:1::1/tcp/4", "/ip4/127.0.0.1/tcp/5", "/garbage"]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3),
       st.lists(st.tuples(st.sampled_from(["admit", "release"]), st.integers(0, 9),
                          st.sampled_from(_ADDRS), st.frozensets(st.integers(0, 9))),
                max_size=60))  # fmt: skip
def test_inbound_subnet_cap_never_overfills_a_subnet(cap_n, ops):
    cap = InboundSubnetCap(cap_n)
    limiter = SubnetLimiter(cap_n)
    model: dict[bytes, str] = {}  # counted peer -> bucket
    for op, i, addr, stale in ops:
        peer = bytes([i])
        if op == "release":
            cap.release(peer)
            model.pop(peer, None)
        else:
            stale_ids = {bytes([j]) for j in stale}
            ok, evicted = cap.admit(peer, addr, lambda p, s=stale_ids: p in s)
            buckets = limiter.subnets([addr])
            if peer in model or not buckets:
                assert ok and evicted == []
            else:
                (bucket,) = buckets
                members = {p for p, b in model.items() if b == bucket}
                if len(members) >= cap_n:  # full: the stale ones go first
                    assert set(evicted) == members & stale_ids
                    for p in evicted:
                        del model[p]
                    members -= set(evicted)
                else:
                    assert evicted == []
                assert ok == (len(members) < cap_n)
                if ok:
                    model[peer] = bucket
        counts = cap.counts()
        assert all(0 < n <= cap_n for n in counts.values())
        expected: dict[str, int] = {}
        for b in model.values():
            expected[b] = expected.get(b, 0) + 1
        assert counts == expected


def test_inbound_subnet_cap_buckets():
    cap = InboundSubnetCap(1)
    assert cap.admit(b"a", "/ip4/10.0.0.1/tcp/1") == (True, [])
    assert cap.admit(b"b", "/ip4/10.0.0.200/tcp/1") == (False, [])  # same /24
    assert cap.admit(b"c", "/ip4/10.0.1.1/tcp/1") == (True, [])
    assert cap.admit(b"d", "/ip4/127.0.0.1/tcp/1") == (True, [])  # loopback exempt
    assert cap.admit(b"e", "") == (True, [])  # unreadable: one shared "none" bucket
    assert cap.admit(b"f", "/garbage") == (False, [])  # the same "none" bucket
    assert cap.refused == 2
    assert cap.admit(b"b", "/ip4/10.0.0.7/tcp/1", lambda p: p == b"a") == (True, [b"a"])
    assert cap.counts() == {"10.0.0.0/24": 1, "10.0.1.0/24": 1, "none": 1}
    with pytest.raises(InvalidTrustConfig):
        InboundSubnetCap(0)
