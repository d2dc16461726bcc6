"""The shared bounded-CBOR scanner (overlay/core/cbor.py): the grammar it accepts, the
bounds it enforces, and agreement with cbor2 on everything it lets through.
(Random and mutated bytes: the ``cbor`` target of tests/bench/test_fuzz_decoders.py.)"""

from __future__ import annotations

import math

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.overlay.core import cbor
from prefixmesh.overlay.core.cbor import CborError, TooManyItems

DEPTH = 8
ITEMS = 4096

# the value space the protocols use: ints, floats, text, bytes, bools, null, arrays, maps
scalars = st.one_of(
    st.integers(-(2**64), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.binary(max_size=20),
    st.booleans(),
    st.none(),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.one_of(st.text(max_size=5), st.integers(0, 99)), inner, max_size=5),
    ),
    max_leaves=30,
)


def _depth(v) -> int:
    """Nesting levels of non-empty containers (what the scanner bounds)."""
    if isinstance(v, list) and v:
        return 1 + max(_depth(x) for x in v)
    if isinstance(v, dict) and v:
        return 1 + max(max(_depth(k), _depth(x)) for k, x in v.items())
    return 0


def _items(v) -> int:
    if isinstance(v, list):
        return 1 + sum(_items(x) for x in v)
    if isinstance(v, dict):
        return 1 + sum(_items(k) + _items(x) for k, x in v.items())
    return 1


@settings(max_examples=150)
@given(values)
def test_accepts_exactly_what_is_within_bounds_and_agrees_with_cbor2(v):
    data = cbor2.dumps(v, canonical=True)
    if _depth(v) <= DEPTH and _items(v) <= ITEMS:
        assert cbor.loads(data, max_depth=DEPTH, max_items=ITEMS) == cbor2.loads(data)
    else:
        with pytest.raises(CborError):
            cbor.loads(data, max_depth=DEPTH, max_items=ITEMS)


@settings(max_examples=100)
@given(values)
def test_every_strict_prefix_and_any_trailing_byte_is_refused(v):
    data = cbor2.dumps(v, canonical=True)
    for cut in range(len(data)):
        with pytest.raises(CborError):
            cbor.scan(data[:cut], max_depth=64, max_items=10**6)
    with pytest.raises(CborError, match="trailing"):
        cbor.scan(data + b"\x00", max_depth=64, max_items=10**6)


@settings(max_examples=300)
@given(st.binary(max_size=256))
def test_random_bytes_raise_only_cbor_error(data):
    try:
        out = cbor.loads(data, max_depth=DEPTH, max_items=ITEMS)
    except CborError:
        return
    # whatever is let through is one plain value that cbor2 reads the same way
    assert out == cbor2.loads(data) or (isinstance(out, float) and math.isnan(out))


@pytest.mark.parametrize(
    "data,match",
    [
        (b"\xc1\x00", "tags"),  # tag 1 (epoch datetime)
        (b"\x9f\x00\xff", "indefinite"),  # indefinite-length array
        (b"\x5f\x41\x00\xff", "indefinite"),
        (b"\x1c", "reserved"),  # additional info 28
        (b"\xf7", "simple value 23"),  # undefined
        (b"\xf0", "simple value 16"),
        (b"\xf8\x20", "one-byte simple"),
        (b"\x5b" + (2**60).to_bytes(8, "big"), "exceeds"),  # a lying byte-string length
        (b"\x9b" + (2**60).to_bytes(8, "big"), "exceeds"),  # a lying array length
        (b"\x19\x01", "truncated"),
        (b"", "truncated"),
    ],
)
def test_refuses_what_the_grammar_excludes(data, match):
    with pytest.raises(CborError, match=match):
        cbor.scan(data, max_depth=DEPTH, max_items=ITEMS)


def test_accepts_false_true_null_and_every_float_width():
    for data in (b"\xf4", b"\xf5", b"\xf6", b"\xf9\x3c\x00", b"\xfa\x3f\x80\x00\x00",
                 cbor2.dumps(1.1)):
        cbor.scan(data, max_depth=DEPTH, max_items=ITEMS)


def test_depth_counts_non_empty_containers():
    cbor.scan(b"\x81" * 3 + b"\x00", max_depth=3, max_items=ITEMS)
    cbor.scan(b"\x81" * 3 + b"\x80", max_depth=3, max_items=ITEMS)  # the empty 4th opens nothing
    with pytest.raises(CborError, match="nesting"):
        cbor.scan(b"\x81" * 4 + b"\x00", max_depth=3, max_items=ITEMS)
    with pytest.raises(CborError, match="nesting"):
        cbor.scan(b"\xa1\x00" * 4 + b"\x00", max_depth=3, max_items=ITEMS)


def test_item_count_is_a_distinct_limit_and_counts_map_keys():
    cbor.scan(cbor2.dumps([1, 2, 3]), max_depth=DEPTH, max_items=4)
    with pytest.raises(TooManyItems, match="items"):
        cbor.scan(cbor2.dumps([1, 2, 3]), max_depth=DEPTH, max_items=3)
    with pytest.raises(TooManyItems):
        cbor.scan(cbor2.dumps({1: 2}), max_depth=DEPTH, max_items=2)
    # a 64 KiB array of one-byte items stops after max_items, before cbor2 sees it
    with pytest.raises(TooManyItems):
        cbor.loads(cbor2.dumps([0] * 60_000), max_depth=DEPTH, max_items=ITEMS)
