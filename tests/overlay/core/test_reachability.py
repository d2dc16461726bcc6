"""Reachability verdicts, dial-back codec, askers, schedule and status line (pure)."""

from __future__ import annotations

import cbor2
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from prefixmesh.overlay.core import reachability as rb
from prefixmesh.overlay.core.reachability import (
    DialbackAnswer,
    DialbackError,
    DialbackRequest,
    DialResult,
    Observation,
    Reachability,
)

PUBLIC_IPS = st.sampled_from(["198.18.0.1", "198.18.0.2", "203.0.113.7", "8.8.4.4", "2001:db8::5"])
LAN_IPS = st.sampled_from(["10.77.1.2", "192.168.1.20", "100.64.3.3", "127.0.0.1", "fe80::1"])


def _addr(ip: str, port: int) -> str:
    return f"/{'ip6' if ':' in ip else 'ip4'}/{ip}/tcp/{port}"


addrs = st.builds(_addr, st.one_of(PUBLIC_IPS, LAN_IPS), st.integers(1, 65535))
results = st.builds(DialResult, addrs, st.booleans(), st.text(max_size=40))
answers = st.builds(DialbackAnswer, st.one_of(st.just(""), PUBLIC_IPS, LAN_IPS),
                    st.integers(0, 65535), st.lists(results, max_size=4).map(tuple))
observations = st.builds(Observation, st.binary(min_size=1, max_size=4),
                         st.one_of(st.none(), st.integers(1, 65535)), answers)


# ---------------------------------------------------------------------------- codec


@given(st.lists(addrs, max_size=4).map(tuple))
def test_request_round_trips(claimed):
    req = DialbackRequest(claimed)
    assert rb.decode_request(rb.encode_request(req)) == req


@given(answers)
def test_answer_round_trips(ans):
    assert rb.decode_answer(rb.encode_answer(ans)) == ans


@settings(max_examples=300)
@given(st.binary(max_size=600))
def test_random_bytes_raise_only_dialback_error(data):
    for decode in (rb.decode_request, rb.decode_answer):
        try:
            decode(data)
        except DialbackError:
            pass


@settings(max_examples=300)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20)
                    | st.binary(max_size=20),
                    lambda kids: st.lists(kids, max_size=5), max_leaves=20))
def test_wrong_structures_raise_only_dialback_error(obj):
    data = cbor2.dumps(obj)
    for decode in (rb.decode_request, rb.decode_answer):
        try:
            decode(data)
        except DialbackError:
            pass


@pytest.mark.parametrize("obj,match", [
    ([1, ["/ip4/1.2.3.4/tcp/1"] * 5], "at most 4"),
    ([1, ["x"]], "not a multiaddr"),
    ([1, ["/" + "a" * 300]], "at most 200"),
    ([2, []], "array of 4"),
    ([2, "1.2.3.4", 70000, []], "0..65535"),
    ([2, "not-an-ip", 1, []], "not an IP"),
    ([2, "1.2.3.4", 1, [["/ip4/1.2.3.4/tcp/1", 1, "x"]]], "boolean"),
    ([9, []], "type 9"),
])
def test_precise_errors(obj, match):
    data = cbor2.dumps(obj)
    with pytest.raises(DialbackError, match=match):
        (rb.decode_request if obj[0] in (1, 9) else rb.decode_answer)(data)


def test_oversized_and_tagged_messages_are_refused():
    with pytest.raises(DialbackError, match="bytes >"):
        rb.decode_request(b"\x82\x01\x81" + b"\x00" * 5000)
    with pytest.raises(DialbackError, match="tags"):
        rb.decode_request(cbor2.dumps([1, [cbor2.CBORTag(1, 5)]]))
    with pytest.raises(DialbackError, match="at most 4"):
        rb.encode_request(DialbackRequest(("/ip4/1.1.1.1/tcp/1",) * 5))


# ---------------------------------------------------------------------------- claims


@given(st.lists(addrs, max_size=8), st.one_of(PUBLIC_IPS, LAN_IPS, st.just("")))
def test_answerer_dials_only_the_seen_ip(claimed, seen_ip):
    to_dial, refused = rb.dialable_claims(claimed, seen_ip)
    assert len(to_dial) + len(refused) == min(len(claimed), rb.MAX_CLAIMED_ADDRS)
    assert all(rb.addr_ip(a) == seen_ip for a in to_dial)
    assert not any(r.ok for r in refused)


def test_circuit_and_dns_claims_are_not_dialled():
    to_dial, refused = rb.dialable_claims(
        ["/ip4/1.2.3.4/tcp/1/p2p/Qm/p2p-circuit", "/dns4/x.org/tcp/1", "/ip4/1.2.3.4/udp/1"],
        "1.2.3.4")
    assert to_dial == [] and len(refused) == 3


# ---------------------------------------------------------------------------- askers


# one IP per peer (a peer with two connections is still one answerer)
unique_candidates = st.lists(st.tuples(st.binary(min_size=1, max_size=2),
                                       st.one_of(PUBLIC_IPS, LAN_IPS)),
                             max_size=10, unique_by=lambda c: c[0])


@given(unique_candidates, st.lists(st.one_of(PUBLIC_IPS, LAN_IPS), max_size=2),
       st.integers(1, 4))
def test_askers_are_distinct_ips_never_ours(cands, own, k):
    picked = rb.choose_askers(cands, own, k)
    ip_of = {}
    for p, ip in cands:
        ip_of.setdefault(p, []).append(ip)
    assert len(picked) <= k and len(set(picked)) == len(picked)
    assert all(p in ip_of for p in picked)
    assert not any(ip in own for p, ip in cands if p in picked)
    assert len({ip for p, ip in cands if p in picked}) == len(picked)
    # as many as asked for whenever that many subnets hold an eligible peer
    eligible_subnets = {rb.subnet_key(ip) for _, ip in cands if ip not in own}
    if len(eligible_subnets) >= k:
        assert len(picked) == k


def test_askers_prefer_other_subnets_then_fill_up():
    cands = [(b"a", "198.18.0.1"), (b"b", "198.18.0.2"), (b"c", "203.0.113.9")]
    assert rb.choose_askers(cands, [], 2) == [b"a", b"c"]
    assert rb.choose_askers(cands, [], 3) == [b"a", b"c", b"b"]
    assert rb.choose_askers(cands, ["198.18.0.1"], 3) == [b"b", b"c"]


# ---------------------------------------------------------------------------- verdict


def _obs(peer: bytes, ok: bool, ip: str = "198.18.0.9", local: int | None = 4001,
         seen_port: int = 4001) -> Observation:
    return Observation(peer, local, DialbackAnswer(ip, seen_port,
                                                   (DialResult(_addr(ip, 4001), ok, "x"),)))


@given(st.lists(observations, max_size=5))
def test_verdict_public_iff_two_answerers_dialled_a_non_lan_address(obs):
    r = rb.verdict(obs)
    assert r.kind in rb.KINDS and r.nat in rb.NAT_KINDS
    confirmers = {o.answerer for o in obs
                  if any(x.ok and not rb.is_lan_ip(rb.addr_ip(x.addr)) for x in o.answer.results)}
    assert (r.kind == "public") == (len(confirmers) >= rb.CONFIRMATIONS)
    assert r.confirmations == len(confirmers)
    if not obs:
        assert r.kind == "unknown"


def test_verdict_examples():
    assert rb.verdict([_obs(b"a", True), _obs(b"b", True)]).kind == "public"
    assert rb.verdict([_obs(b"a", True)]).kind == "unknown"
    assert rb.verdict([_obs(b"a", True), _obs(b"b", False)]).kind == "private"
    # two answerers both on the LAN: reachable by neighbours only
    lan = rb.verdict([_obs(b"a", True, "10.0.0.5"), _obs(b"b", True, "10.0.0.6")])
    assert lan.kind == "private"
    # the same peer twice is one confirmation
    assert rb.verdict([_obs(b"a", True), _obs(b"a", True)]).kind == "unknown"


def test_nat_kind_from_seen_ports():
    home = [_obs(b"a", False, local=4101, seen_port=4101), _obs(b"b", False, local=4101, seen_port=4101)]
    assert rb.verdict(home).nat == "port-preserving"
    sym = [_obs(b"a", False, local=4101, seen_port=47217), _obs(b"b", False, local=4101, seen_port=47314)]
    assert rb.verdict(sym).nat == "symmetric"
    assert rb.verdict([_obs(b"a", False, local=None)]).nat == "unknown"
    assert rb.verdict(sym).seen_ip == "198.18.0.9"


@given(st.lists(st.tuples(st.integers(1, 65535), st.integers(1, 65535)), min_size=1, max_size=4))
def test_nat_kind_symmetric_iff_some_port_rewritten(ports):
    obs = [_obs(bytes([i]), False, local=a, seen_port=b) for i, (a, b) in enumerate(ports)]
    want = "symmetric" if any(a != b for a, b in ports) else "port-preserving"
    assert rb.nat_kind(obs) == want


# ---------------------------------------------------------------------------- schedule


@given(st.lists(st.tuples(st.floats(0, 2000), st.booleans()), max_size=20))
@example([(241.47000785939704, False)])  # (t + 15) - t < 15 in floating point
def test_schedule_rechecks_on_time_and_on_address_change(steps):
    s = rb.RecheckSchedule()
    now = 0.0
    a = ["/ip4/1.2.3.4/tcp/1"]
    assert s.due(now, a)
    settled = Reachability("private", "symmetric", "x")
    s.checked(now, a, settled)
    for dt, change in steps:
        now += dt
        if change:
            assert s.due(now, a + ["/ip4/5.6.7.8/tcp/1"])
        assert s.due(now, a) == (now >= rb.RECHECK_INTERVAL_S)
    s.checked(now, a, rb.UNKNOWN)
    assert not s.due(now + rb.RETRY_UNKNOWN_S / 2, a)
    assert s.due(now + rb.RETRY_UNKNOWN_S, a)


# ---------------------------------------------------------------------------- status


def test_status_lines_exactly():
    pub = Reachability("public", "port-preserving", "x")
    priv = Reachability("private", "port-preserving", "x")
    assert rb.status_line(pub, reserved_relays=["R"]) == "public"
    assert rb.status_line(priv, reserved_relays=["R1", "R2"]) == "private (reachable via relay R1)"
    assert rb.status_line(priv, reserved_relays=["R"], punched_peers=3) == \
        "private (direct via hole punching with 3 peers)"
    assert rb.status_line(priv, tried_relays=["R1", "R2"]) == \
        "private, not reachable: no relay accepted a reservation (tried R1, R2)"
    assert rb.status_line(priv) == "private, not reachable: no relay known yet"
    assert rb.status_line(priv, relay_failure="relay service off") == \
        "private, not reachable: relay service off"
    assert rb.status_line(rb.UNKNOWN) == "unknown: not checked yet"
