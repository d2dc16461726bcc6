"""The content digest of an inference request: what a tenant credential binds.

A tenant credential (``node/tenants.py``) is an HMAC under the namespace key over the
request's id, its deadline and :func:`content_digest` of the request, so a relay (which
needs no secret to relay) cannot change the prompt, the sampling settings or any other
field a serving node acts on without the next node that holds the secret refusing the
request (issue 14, finding 3).

The digest covers **every field of** :class:`wire.Request` **except** :data:`RELAY_FIELDS`,
the ones relays legitimately change on the way:

* ``credential``: the MAC itself;
* ``hop_budget``: each hop decrements it (and clamps it to its own limit);
* ``visited`` and ``trace``: each hop appends itself;
* ``holders``: a router that is not a home of the prompt's partition carries the home's
  lookup answer on (unverified routing hints; see D18).

It is computed over the canonical CBOR encoding of the request's wire form (the frame
encoder of ``wire``) with those fields reset to their defaults, so a field added to
``Request`` and its encoder (as ``grammar`` and ``logprobs`` were) is covered without
touching this module; ``tests/overlay/core/test_reqdigest.py`` checks, field by field
from ``dataclasses.fields``, that changing any other field changes the digest.

    content_digest(req) = SHA-256(b"prefixmesh/request-content/v1\\x00"
                                  || canonical CBOR of the request with RELAY_FIELDS reset)

Pure code: ``hashlib``, ``cbor2`` and ``wire`` only; no clock.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import cbor2

from . import wire

__all__ = ["CONTENT_LABEL", "DIGEST_BYTES", "RELAY_FIELDS", "content_digest", "strip_relay_fields"]

CONTENT_LABEL = b"prefixmesh/request-content/v1\x00"
DIGEST_BYTES = 32
#: the fields of :class:`wire.Request` that relays change; everything else is content
RELAY_FIELDS = frozenset({"credential", "hop_budget", "visited", "trace", "holders"})


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


_RELAY_DEFAULTS = {f.name: _default(f) for f in dataclasses.fields(wire.Request)
                   if f.name in RELAY_FIELDS}
if set(_RELAY_DEFAULTS) != RELAY_FIELDS:  # pragma: no cover - a renamed wire field
    raise ImportError(f"wire.Request lacks relay fields {RELAY_FIELDS - set(_RELAY_DEFAULTS)}")


def strip_relay_fields(req: wire.Request) -> wire.Request:
    """``req`` with every field of :data:`RELAY_FIELDS` reset to its default."""
    return dataclasses.replace(req, **_RELAY_DEFAULTS)


def content_digest(req: wire.Request) -> bytes:
    """The 32-byte digest of everything in ``req`` a relay may not change."""
    obj = wire._to_obj(strip_relay_fields(req))  # the frame encoder's wire form
    body = cbor2.dumps(obj, canonical=True)
    return hashlib.sha256(CONTENT_LABEL + body).digest()
