"""node/sizes.py: byte sizes as people write them, the rejected forms, the 1 PiB cap, and
format_size as parse_size's inverse (property-based). Sizes in config keys:
tests/node/test_config.py."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.node.sizes import MAX_SIZE, SizeError, format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 * 1024**2),
        ("2GB", 2 * 10**9),
        ("1.5 GiB", 3 * 1024**3 // 2),
        ("1.1GB", 1_100_000_000),
        ("10kb", 10_000),
        ("7 B", 7),
        ("1048576", 1048576),
        (4096, 4096),
        (0, 0),
    ],
)
def test_parse_size_accepts(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "bad", ["12 parsecs", "", "1.5", "-1GB", "2G", "GB", "1e9", True, 1.5, -3, None, "3 MiB s"]
)
def test_parse_size_rejects(bad):
    with pytest.raises(SizeError):
        parse_size(bad)


def test_parse_size_limit():
    assert parse_size("1024TiB") == MAX_SIZE
    with pytest.raises(SizeError, match="1 PiB"):
        parse_size("2000TB")


@settings(max_examples=200)
@given(st.integers(min_value=0, max_value=MAX_SIZE))
def test_format_size_round_trips(n):
    assert parse_size(format_size(n)) == n
