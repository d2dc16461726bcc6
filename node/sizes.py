"""Byte sizes as people write them: ``512MiB``, ``2GB``, ``1.5 GiB``, ``1048576``.

Grammar (case-insensitive, spaces allowed between number and unit)::

    size   := digits ["." digits] [unit]      |  a non-negative TOML integer
    unit   := "B" | "KB" | "MB" | "GB" | "TB"        (powers of 1000)
            | "KiB" | "MiB" | "GiB" | "TiB"          (powers of 1024)

A number without a unit is bytes and must then be a whole number. Bare ``K``/``M``/``G``
are rejected on purpose: they are ambiguous (1000 or 1024?) and a budget off by 7% is
a silent surprise. A fractional result is rounded down to whole bytes. Sizes are capped at
:data:`MAX_SIZE` (1 PiB) so that a typo like ``2000TB`` is an error, not a plan.

:func:`format_size` is the inverse used by ``--print-config``: it picks the largest binary
unit that represents the value *exactly*, so ``parse_size(format_size(n)) == n`` always.

Pure code: standard library only.
"""

from __future__ import annotations

import re

__all__ = ["SizeError", "MAX_SIZE", "SIZE_HINT", "parse_size", "format_size"]

MAX_SIZE = 1024**5  # 1 PiB
SIZE_HINT = "use e.g. 512MiB, 2GB"

_UNITS = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_FORMAT_UNITS = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


class SizeError(ValueError):
    """A value that is not a byte size; the message says why and how to write one."""


def parse_size(value: object) -> int:
    """Bytes from an ``int`` (bytes) or a size string; raises :class:`SizeError`."""
    if isinstance(value, bool):  # bool is an int subclass; `true` is not a size
        raise SizeError(f"{_show(value)} is not a size ({SIZE_HINT})")
    if isinstance(value, int):
        if value < 0:
            raise SizeError(f"{value} is negative; a size is at least 0 bytes")
        if value > MAX_SIZE:
            raise SizeError(f"{value} bytes is more than the 1 PiB limit")
        return value
    if not isinstance(value, str):
        raise SizeError(f"{_show(value)} is not a size ({SIZE_HINT})")
    # Anything longer than this can't be a size under the 1 PiB limit; checking first also
    # keeps int() away from its 4,300-digit refusal and from quadratic parsing.
    if len(value) > 64:
        raise SizeError(f"{_show(value)} is not a size ({SIZE_HINT})")
    m = _SIZE_RE.match(value)
    if m is None:
        raise SizeError(f"{_show(value)} is not a size ({SIZE_HINT})")
    number, unit = m.group(1), m.group(2).lower()
    if unit == "":
        if "." in number:
            raise SizeError(f"{_show(value)}: a size without a unit is whole bytes ({SIZE_HINT})")
        unit = "b"
    if unit not in _UNITS:
        raise SizeError(f"{_show(value)} is not a size ({SIZE_HINT})")
    whole, _, frac = number.partition(".")
    # exact decimal arithmetic: 1.1GB is 1_100_000_000 bytes, not 1_100_000_000.0000002
    scale = 10 ** len(frac)
    n_bytes = (int(whole) * scale + (int(frac) if frac else 0)) * _UNITS[unit] // scale
    if n_bytes > MAX_SIZE:
        raise SizeError(f"{_show(value)} is more than the 1 PiB limit")
    return n_bytes


def format_size(n_bytes: int) -> str:
    """The exact, shortest binary-unit spelling of ``n_bytes`` (``"512MiB"``, ``"1000B"``)."""
    if isinstance(n_bytes, bool) or not isinstance(n_bytes, int) or n_bytes < 0:
        raise SizeError(f"{n_bytes!r} is not a byte count")
    for name, factor in _FORMAT_UNITS:
        if n_bytes and n_bytes % factor == 0:
            return f"{n_bytes // factor}{name}"
    return f"{n_bytes}B"


def _show(value: object) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)
