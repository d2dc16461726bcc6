"""Bounded CBOR decoding: the one structural pre-scan every codec runs on peer bytes.

:func:`scan` walks the CBOR item headers iteratively (no recursion, no objects built) and
refuses anything outside the small grammar prefixmesh's protocols use: tags (cbor2 would
turn them into datetimes, decimals, regexes...), indefinite lengths and reserved
encodings, simple values other than false/true/null (floats are allowed), more than
``max_depth`` nested non-empty containers, more than ``max_items`` items
in all (map keys count), and any declared length or item count larger than the bytes
that remain, so a header declaring a 2^60-byte string or array costs O(1). The work is
O(min(len(data), max_items)) whatever the bytes. Only then does :func:`loads` let cbor2
build the objects (measured with cbor2 6.3: it survives such headers by reading in chunks
and caps nesting at 400; the scan makes the bound ours and the grammar strict).

Users: ``wire`` (stream frames), ``digest`` (signed records, via ``loads_bounded``) and
the exchange messages of ``antientropy``/``partition``. Each maps :class:`CborError` to
its own error types.

Pure code: imports ``cbor2`` only.
"""

from __future__ import annotations

import cbor2

__all__ = ["CborError", "TooManyItems", "scan", "loads"]


class CborError(ValueError):
    """The bytes are not exactly one CBOR item of the accepted grammar within the bounds."""


class TooManyItems(CborError):
    """More than ``max_items`` CBOR items (a limit, where the others are malformations)."""


def _head(data: bytes, pos: int) -> tuple[int, int, int, int]:
    """(major type, additional info, argument, position after the head) of the item at pos."""
    n = len(data)
    if pos >= n:
        raise CborError("CBOR item truncated")
    initial = data[pos]
    major, info = initial >> 5, initial & 0x1F
    pos += 1
    if info < 24:
        return major, info, info, pos
    if info <= 27:
        width = 1 << (info - 24)
        if pos + width > n:
            raise CborError("CBOR head truncated")
        return major, info, int.from_bytes(data[pos : pos + width], "big"), pos + width
    raise CborError(f"CBOR additional info {info} (indefinite or reserved) refused")


def scan(data: bytes, *, max_depth: int, max_items: int) -> None:
    """Raise :class:`CborError` unless ``data`` is exactly one CBOR item of the grammar."""
    n = len(data)
    pos = 0
    # items still to read in each open container; the root is one item at depth 0
    pending = [1]
    seen = 0
    while pending:
        if pending[-1] == 0:
            pending.pop()
            continue
        pending[-1] -= 1
        seen += 1
        if seen > max_items:
            raise TooManyItems(f"more than {max_items} CBOR items")
        major, info, arg, pos = _head(data, pos)
        if major in (2, 3):
            if arg > n - pos:
                raise CborError(f"CBOR string of {arg} bytes exceeds the {n - pos} that remain")
            pos += arg
        elif major in (4, 5):
            count = arg * 2 if major == 5 else arg
            # every item takes at least one byte, so a count beyond the rest is a lie
            if count > n - pos:
                raise CborError(f"CBOR container of {count} items exceeds the {n - pos} bytes left")
            if count:  # an empty container opens no level for cbor2 to recurse into
                if len(pending) > max_depth:
                    raise CborError(f"CBOR nesting deeper than {max_depth}")
                pending.append(count)
        elif major == 6:
            raise CborError("CBOR tags are not accepted")
        elif major == 7 and info < 24 and arg not in (20, 21, 22):  # false, true, null
            raise CborError(f"CBOR simple value {arg} is not accepted")
        elif major == 7 and info == 24:
            raise CborError("CBOR one-byte simple value is not accepted")
        # majors 0/1 (integers) and 7 with info 25-27 (floats): the head was the item
    if pos != n:
        raise CborError(f"{n - pos} trailing bytes after the CBOR item")


def loads(data: bytes, *, max_depth: int, max_items: int) -> object:
    """:func:`scan`, then decode with cbor2; any cbor2 failure becomes a :class:`CborError`."""
    scan(data, max_depth=max_depth, max_items=max_items)
    try:
        return cbor2.loads(data)
    except Exception as exc:  # cbor2 raises assorted ValueError/CBORError subclasses
        raise CborError(f"invalid CBOR: {exc}") from None
