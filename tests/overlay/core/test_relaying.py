"""Pure relaying decisions (overlay/core/relaying.py): addresses, the reachability guess,
relay choice, circuit admission and byte pacing."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.overlay.core.relaying import (
    ByteBucket,
    CircuitBook,
    RelayChooser,
    circuit_addr,
    is_circuit,
    keep_peer_addr,
    reachability_from_addrs,
    relay_of_circuit,
    transport_part,
)

R = "12D3KooWRelay"
B = "12D3KooWHomeB"


def test_circuit_addresses_keep_their_relay_part():
    c = circuit_addr(f"/ip4/198.18.0.1/tcp/4001/p2p/{R}", R)
    assert c == f"/ip4/198.18.0.1/tcp/4001/p2p/{R}/p2p-circuit"
    assert is_circuit(c) and relay_of_circuit(c) == R
    assert transport_part(f"{c}/p2p/{B}") == c
    assert transport_part(f"/ip4/1.2.3.4/tcp/5/p2p/{B}") == "/ip4/1.2.3.4/tcp/5"
    assert relay_of_circuit("/ip4/1.2.3.4/tcp/5") is None


def test_reachability_guess():
    assert reachability_from_addrs(["/ip4/198.18.0.1/tcp/4001"]) == "public"
    assert reachability_from_addrs(["/ip4/10.77.1.2/tcp/4101"]) == "private"
    assert reachability_from_addrs(["/ip4/192.168.1.5/tcp/1", "/ip4/127.0.0.1/tcp/1"]) \
        == "private"
    assert reachability_from_addrs(["/ip4/127.0.0.1/tcp/1"]) == "unknown"
    assert reachability_from_addrs(["/ip4/10.0.0.1/tcp/1", "/ip4/8.8.8.8/tcp/1"]) == "public"
    assert reachability_from_addrs([]) == "unknown"


def test_private_addresses_of_peers_off_our_lan_are_dropped():
    own = ["10.77.1.2", "127.0.0.1"]
    assert keep_peer_addr("/ip4/10.77.1.9/tcp/1", own)  # our LAN
    assert not keep_peer_addr("/ip4/10.77.2.2/tcp/4101", own)  # another home
    assert keep_peer_addr("/ip4/198.18.0.1/tcp/4001", own)
    assert keep_peer_addr("/ip4/127.0.0.1/tcp/4001", own)  # local clusters keep working
    assert keep_peer_addr(f"/ip4/198.18.0.1/tcp/4001/p2p/{R}/p2p-circuit", own)
    assert keep_peer_addr("/dns4/example.org/tcp/1", own)


relays = st.lists(st.sampled_from([f"R{i}" for i in range(8)]), max_size=8)


@given(boot=relays, known=relays, held=relays, failed=relays,
       want=st.integers(0, 4), age=st.floats(0, 100))
@settings(max_examples=200, deadline=None)
def test_relay_choice(boot, known, held, failed, want, age):
    ch = RelayChooser(retry_s=30.0)
    for r in failed:
        ch.failed(r, 0.0)
    picked = ch.next([(r, f"/a/{r}") for r in boot], [(r, f"/a/{r}") for r in known],
                     held, age, want)
    ids = [r for r, _ in picked]
    assert len(ids) <= want and len(set(ids)) == len(ids)
    assert not set(ids) & set(held)
    if age < 30.0:
        assert not set(ids) & set(failed)
    # bootstrap peers come first: no known-only relay precedes an eligible bootstrap one
    eligible = [r for r in dict.fromkeys(boot + known)
                if r not in held and (age >= 30.0 or r not in failed)]
    assert ids == eligible[:want]


ops = st.lists(st.tuples(st.booleans(), st.sampled_from("abcd"), st.sampled_from("xyz")),
               max_size=120)


@given(ops=ops)
@settings(max_examples=200, deadline=None)
def test_circuit_book_never_exceeds_its_limits(ops):
    book = CircuitBook(max_total=6, per_dest=2, per_subnet=3)
    tickets: list[int] = []
    for open_, dest, subnet in ops:
        if open_:
            t = book.admit(dest, subnet)
            if isinstance(t, int):
                tickets.append(t)
        elif tickets:
            book.release(tickets.pop(0))
            book.release(-1)  # unknown tickets are ignored
        assert len(book.open) <= 6
        assert all(v <= 2 for v in book.by_dest.values())
        assert all(v <= 3 for v in book.by_subnet.values())
        assert sum(book.by_dest.values()) == len(book.open) == sum(book.by_subnet.values())
    for t in tickets:
        book.release(t)
    assert not book.open and not book.by_dest and not book.by_subnet


@given(chunks=st.lists(st.tuples(st.integers(1, 200_000), st.floats(0, 2)), max_size=60))
@settings(max_examples=200, deadline=None)
def test_byte_bucket_bounds_what_is_released(chunks):
    rate, burst = 100_000.0, 50_000.0
    bucket = ByteBucket(rate, burst)
    now, released = 0.0, []
    for n, gap in chunks:
        now += gap
        wait = bucket.take(n, now)
        assert wait >= 0
        released.append((now + wait, n))
        now += wait  # a sender waits before its next chunk
    for t, _ in released:
        sent = sum(n for t2, n in released if t2 <= t)
        assert sent <= burst + rate * t + 1e-6 * sent
