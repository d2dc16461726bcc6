"""Tenant-scoped cache namespaces: secrets, namespace keys, and request credentials.

A *tenant* is a named cache namespace. Its block hashes are keyed by a namespace key

    namespace_key = inference.blocks.derive_namespace_key(secret, name, model_fingerprint)
    ns_id         = inference.blocks.namespace_id(namespace_key)        (8 bytes, public)

so the hashes one tenant gossips are unlinkable to another tenant's (and to another
model's), and a peer that lacks the secret learns nothing from them.

Visibility
----------
``private`` (the default): the secret comes from the config (``secret = "..."``, at least
:data:`MIN_SECRET_BYTES` bytes) or from a file (``secret_file``; must be a regular, non-empty
file that group and others cannot access, like a key file). Only nodes configured with the
secret can cache or serve the namespace.

``public``: an explicit opt-in for prefixes meant to be shared by everyone, such as a
common system prompt. The secret is the well-known :func:`public_secret` of the name, so
any node can compute the namespace's hashes and serve it. A public tenant must not set a
secret. When a config declares no tenants at all, a single public tenant named
:data:`DEFAULT_PUBLIC_TENANT` (``"public"``) exists, so the out-of-the-box demo works.

``allowed_peers`` (optional): base58 peer ids allowed to *serve* the namespace; empty means
any node that holds the secret. Routing should not pick other peers for it.

Request credentials
-------------------
A request in a namespace carries a credential that proves knowledge of the namespace key
without revealing it and binds it to one request, its deadline and its content::

    credential = HMAC-SHA256(namespace_key,
                             b"prefixmesh/cred/v2" || u16be(len(request_id)) || request_id
                             || f64be(deadline) || content_digest(request))

``deadline`` is the request's absolute deadline in seconds (float, as carried on the wire).
``content_digest`` (``overlay/core/reqdigest.py``) covers every field of the wire request
except those relays legitimately change (hop budget, visited set, route trace, carried
holders, the credential itself): namespace, prompt (messages or token ids), sampling,
stream flag, grammar, logprobs, and any field added to the request later. So a relay
that rewrites the prompt or the sampling settings makes the request fail at the next
node that holds the secret (issue 14, finding 3). :meth:`Tenant.sign` signs a request,
:meth:`Tenant.check_request` checks one; an entry node that turns messages into token
ids holds the secret and signs the tokenized request again.
:func:`check_credential` recomputes the MAC and compares in constant time; it raises
:class:`MissingCredential`, :class:`ForgedCredential` (wrong length, or a MAC that does
not match the request content under this namespace's key),
:class:`ExpiredCredential` (``now > deadline + clock_skew_s``) or
:class:`CredentialTooLong` (deadline further than ``max_lifetime_s`` ahead: bounds how
long a captured credential can be replayed; a node remembers the requests it accepted
until their deadline passes, ``overlay/core/replay.py``, so it never serves one twice). A node *not* configured for a namespace (``TenantRegistry.lookup`` returns
``None``) may relay its requests but never caches or serves them.

Public namespaces use the same credentials; anyone can make them, which is the point.

Pure code: standard library, ``inference.blocks``, ``overlay.core.reqdigest`` and
``overlay.privatefile`` only.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from prefixmesh.inference.core.blocks import derive_namespace_key, namespace_id
from prefixmesh.overlay.core import wire
from prefixmesh.overlay.core.reqdigest import DIGEST_BYTES, content_digest
from prefixmesh.overlay.privatefile import (
    InsecureFileMode,
    NotARegularFile,
    OversizeFile,
    PrivateFileNotFound,
    PrivateFileUnreadable,
    read_private_file,
)

__all__ = [
    "VISIBILITIES",
    "DEFAULT_PUBLIC_TENANT",
    "MIN_SECRET_BYTES",
    "MAX_SECRET_BYTES",
    "CREDENTIAL_BYTES",
    "CREDENTIAL_LABEL",
    "TenantError",
    "TenantConfigError",
    "CredentialError",
    "MissingCredential",
    "ForgedCredential",
    "ExpiredCredential",
    "CredentialTooLong",
    "TenantSpec",
    "Tenant",
    "TenantRegistry",
    "public_secret",
    "parse_tenant",
    "read_secret_file",
    "default_tenant_specs",
    "make_credential",
    "check_credential",
]

VISIBILITIES = ("private", "public")
DEFAULT_PUBLIC_TENANT = "public"
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096  # also bounds what we read from a secret file
CREDENTIAL_BYTES = 32
CREDENTIAL_LABEL = b"prefixmesh/cred/v2"
_PUBLIC_SECRET_LABEL = b"prefixmesh/public-namespace/v1/"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_TENANT_KEYS = ("secret", "secret_file", "visibility", "allowed_peers")
_MAX_ALLOWED_PEERS = 1024


# --- errors -----------------------------------------------------------------------------


class TenantError(ValueError):
    """Base class of every tenant and credential error."""


class TenantConfigError(TenantError):
    """A ``[tenants.NAME]`` table is wrong. ``key`` names the offending key (or ``""``)."""

    def __init__(self, tenant: str, key: str, problem: str):
        self.tenant = tenant
        self.key = key
        self.problem = problem
        where = f"[tenants.{tenant}]" + (f".{key}" if key else "")
        super().__init__(f"{where}: {problem}")


class CredentialError(TenantError):
    """A request credential was refused."""


class MissingCredential(CredentialError):
    """The request carries no credential for its namespace."""


class ForgedCredential(CredentialError):
    """The credential does not match the namespace key and the request's id, deadline and
    content (changed after signing, or signed with another secret)."""


class ExpiredCredential(CredentialError):
    """The request's deadline has passed."""


class CredentialTooLong(CredentialError):
    """The deadline is further ahead than a credential may live."""


# --- tenants ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TenantSpec:
    """A tenant as configured: what a config file says, before any model is known."""

    name: str
    secret: bytes = field(repr=False)
    visibility: str = "private"
    allowed_peers: tuple[bytes, ...] = ()
    # where the secret came from, for --print-config: "inline", "file", or "public"
    secret_source: str = "inline"
    secret_file: Path | None = None

    @property
    def public(self) -> bool:
        return self.visibility == "public"


@dataclass(frozen=True)
class Tenant:
    """A tenant bound to one model: its namespace key and public id."""

    spec: TenantSpec
    namespace_key: bytes = field(repr=False)
    ns_id: bytes

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def visibility(self) -> str:
        return self.spec.visibility

    @property
    def allowed_peers(self) -> tuple[bytes, ...]:
        return self.spec.allowed_peers

    def may_serve(self, peer_id: bytes) -> bool:
        """Whether ``peer_id`` may serve this namespace (``allowed_peers`` empty: anyone)."""
        return not self.spec.allowed_peers or bytes(peer_id) in self.spec.allowed_peers

    def credential(self, request_id: bytes, deadline: float, content: bytes) -> bytes:
        return make_credential(self.namespace_key, request_id, deadline, content)

    def check(self, request_id: bytes, deadline: float, credential: bytes | None, *,
              content: bytes, now: float, **kwargs: float) -> None:
        check_credential(self.namespace_key, request_id, deadline, credential,
                         content=content, now=now, **kwargs)

    def sign(self, req: wire.Request) -> wire.Request:
        """``req`` with its credential: binds its id, deadline and content digest."""
        return replace(req, credential=self.credential(req.id, req.deadline,
                                                       content_digest(req)))

    def check_request(self, req: wire.Request, *, now: float, **kwargs: float) -> None:
        """Accept ``req`` (signed by :meth:`sign` and changed only in its relay fields) or
        raise a :class:`CredentialError`."""
        self.check(req.id, req.deadline, req.credential, content=content_digest(req),
                   now=now, **kwargs)

    @classmethod
    def derive(cls, spec: TenantSpec, model_fingerprint: bytes) -> Tenant:
        key = derive_namespace_key(spec.secret, spec.name, model_fingerprint)
        return cls(spec=spec, namespace_key=key, ns_id=namespace_id(key))


class TenantRegistry:
    """The tenants a node (or client) is configured for, bound to one model."""

    def __init__(self, tenants: Iterable[Tenant]):
        self._by_id: dict[bytes, Tenant] = {}
        self._by_name: dict[str, Tenant] = {}
        for t in tenants:
            if t.name in self._by_name:
                raise TenantError(f"tenant {t.name!r} configured twice")
            if t.ns_id in self._by_id:  # 2^-64 per pair; would mean the same key twice
                raise TenantError(f"tenants {self._by_id[t.ns_id].name!r} and {t.name!r} "
                                  "derive the same namespace id")
            self._by_id[t.ns_id] = t
            self._by_name[t.name] = t

    @classmethod
    def from_specs(cls, specs: Iterable[TenantSpec], model_fingerprint: bytes) -> TenantRegistry:
        return cls(Tenant.derive(s, model_fingerprint) for s in specs)

    def lookup(self, ns_id: bytes) -> Tenant | None:
        """The tenant for a namespace id, or None: then relay only, never cache or serve."""
        return self._by_id.get(bytes(ns_id))

    def by_name(self, name: str) -> Tenant | None:
        return self._by_name.get(name)

    def names(self) -> list[str]:
        return list(self._by_name)

    def __iter__(self) -> Iterator[Tenant]:
        return iter(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)

    def __contains__(self, ns_id: object) -> bool:
        return isinstance(ns_id, bytes | bytearray) and bytes(ns_id) in self._by_id


def public_secret(name: str) -> bytes:
    """The well-known secret of a public namespace: anyone can compute it from the name."""
    return _PUBLIC_SECRET_LABEL + name.encode("utf-8")


def default_tenant_specs() -> tuple[TenantSpec, ...]:
    """The tenants used when a config declares none: one public namespace ``public``."""
    return (
        TenantSpec(
            name=DEFAULT_PUBLIC_TENANT,
            secret=public_secret(DEFAULT_PUBLIC_TENANT),
            visibility="public",
            secret_source="public",
        ),
    )


def read_secret_file(path: Path) -> bytes:
    """The secret in ``path``: trailing whitespace stripped; raises ValueError.

    Refuses a file that is not regular, that group or others may access (like a key
    file), that is empty, or that is larger than :data:`MAX_SECRET_BYTES`; never follows
    a symlink (see :func:`prefixmesh.overlay.privatefile.read_private_file`).
    """
    try:
        content = read_private_file(path, MAX_SECRET_BYTES)
    except PrivateFileNotFound:
        raise ValueError(f"{path}: file not found") from None
    except PrivateFileUnreadable as exc:
        raise ValueError(f"{path}: cannot read ({exc.strerror})") from None
    except NotARegularFile:
        raise ValueError(f"{path}: not a regular file") from None
    except InsecureFileMode as exc:
        raise ValueError(
            f"{path}: readable by group or others (mode {exc.mode:04o}); "
            f"fix with: chmod 600 {path}"
        ) from None
    except OversizeFile:
        raise ValueError(
            f"{path}: more than {MAX_SECRET_BYTES} bytes; is this the right file?"
        ) from None
    secret = content.rstrip(b" \t\r\n")
    if not secret:
        raise ValueError(f"{path}: file is empty")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{path}: secret is {len(secret)} bytes, fewer than {MIN_SECRET_BYTES}")
    return secret


def parse_tenant(name: str, table: object, *, base_dir: Path | None = None) -> TenantSpec:
    """Validate one ``[tenants.NAME]`` table; raises :class:`TenantConfigError`.

    A relative ``secret_file`` is resolved against ``base_dir`` (the config file's folder).
    """
    # the identity module is pure too; imported here so that tenants.py loads without it
    from prefixmesh.overlay.core.identity import IdentityError, peer_id_from_b58

    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise TenantConfigError(
            str(name), "", "a tenant name is 1-64 characters of letters, digits, '.', '_', '-' "
            "and starts with a letter or digit"
        )
    if not isinstance(table, Mapping):
        raise TenantConfigError(name, "", f"must be a table, not {_type_name(table)}")
    for key in table:
        if key not in _TENANT_KEYS:
            raise TenantConfigError(
                name, str(key), f"unknown key (known: {', '.join(_TENANT_KEYS)})"
            )

    visibility = table.get("visibility", "private")
    if not isinstance(visibility, str):
        raise TenantConfigError(name, "visibility", f"must be a string, not {_type_name(visibility)}")
    if visibility not in VISIBILITIES:
        raise TenantConfigError(
            name, "visibility", f'"{visibility}" is not one of: {", ".join(VISIBILITIES)}'
        )

    allowed_raw = table.get("allowed_peers", [])
    if not isinstance(allowed_raw, list):
        raise TenantConfigError(name, "allowed_peers",
                                f"must be a list of peer ids, not {_type_name(allowed_raw)}")
    if len(allowed_raw) > _MAX_ALLOWED_PEERS:
        raise TenantConfigError(name, "allowed_peers", f"more than {_MAX_ALLOWED_PEERS} peers")
    allowed: list[bytes] = []
    for i, text in enumerate(allowed_raw):
        if not isinstance(text, str):
            raise TenantConfigError(name, f"allowed_peers[{i}]",
                                    f"must be a string peer id, not {_type_name(text)}")
        try:
            pid = peer_id_from_b58(text)
        except IdentityError:
            raise TenantConfigError(
                name, f"allowed_peers[{i}]", f'"{text}" is not a peer id (expected 12D3KooW...)'
            ) from None
        if pid not in allowed:
            allowed.append(pid)

    has_secret, has_file = "secret" in table, "secret_file" in table
    if visibility == "public":
        if has_secret or has_file:
            key = "secret" if has_secret else "secret_file"
            raise TenantConfigError(
                name, key, "a public namespace uses a well-known secret derived from its name; "
                "remove the secret or make the tenant private"
            )
        return TenantSpec(name=name, secret=public_secret(name), visibility="public",
                          allowed_peers=tuple(allowed), secret_source="public")

    if has_secret and has_file:
        raise TenantConfigError(name, "secret_file", "set either secret or secret_file, not both")
    if not has_secret and not has_file:
        raise TenantConfigError(
            name, "", "a private tenant needs secret or secret_file "
            '(or visibility = "public" for a namespace anyone may use)'
        )
    if has_secret:
        secret_text = table["secret"]
        if not isinstance(secret_text, str):
            raise TenantConfigError(name, "secret", f"must be a string, not {_type_name(secret_text)}")
        secret = secret_text.encode("utf-8")
        if not secret:
            raise TenantConfigError(name, "secret", "is empty")
        if len(secret) < MIN_SECRET_BYTES:
            raise TenantConfigError(
                name, "secret", f"is {len(secret)} bytes; use at least {MIN_SECRET_BYTES} "
                "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
            )
        if len(secret) > MAX_SECRET_BYTES:
            raise TenantConfigError(name, "secret", f"is longer than {MAX_SECRET_BYTES} bytes")
        return TenantSpec(name=name, secret=secret, visibility="private",
                          allowed_peers=tuple(allowed), secret_source="inline")

    file_text = table["secret_file"]
    if not isinstance(file_text, str) or not file_text:
        raise TenantConfigError(name, "secret_file", "must be a non-empty path string")
    try:
        path = Path(file_text).expanduser()
    except RuntimeError as exc:  # "~nosuchuser/..."
        raise TenantConfigError(name, "secret_file", str(exc)) from None
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    try:
        secret = read_secret_file(path)
    except ValueError as exc:
        raise TenantConfigError(name, "secret_file", str(exc)) from None
    return TenantSpec(name=name, secret=secret, visibility="private",
                      allowed_peers=tuple(allowed), secret_source="file", secret_file=path)


# --- credentials ------------------------------------------------------------------------


def _credential_message(request_id: bytes, deadline: float, content: bytes) -> bytes:
    rid = bytes(request_id)
    if len(rid) > 0xFFFF:
        raise CredentialError("request id longer than 65535 bytes")
    d = float(deadline)
    if not math.isfinite(d):
        raise CredentialError("deadline must be a finite number of seconds")
    if not isinstance(content, bytes | bytearray) or len(content) != DIGEST_BYTES:
        raise CredentialError(f"content digest must be {DIGEST_BYTES} bytes "
                              "(overlay.core.reqdigest.content_digest)")
    return (CREDENTIAL_LABEL + struct.pack(">H", len(rid)) + rid + struct.pack(">d", d)
            + bytes(content))


def make_credential(namespace_key: bytes, request_id: bytes, deadline: float,
                    content: bytes) -> bytes:
    """The 32-byte credential for one request in the namespace of ``namespace_key``;
    ``content`` is the request's :func:`~prefixmesh.overlay.core.reqdigest.content_digest`."""
    if not isinstance(namespace_key, bytes) or not namespace_key:
        raise CredentialError("namespace key must be non-empty bytes")
    return hmac.new(namespace_key, _credential_message(request_id, deadline, content),
                    hashlib.sha256).digest()


def check_credential(
    namespace_key: bytes,
    request_id: bytes,
    deadline: float,
    credential: bytes | None,
    *,
    content: bytes,
    now: float,
    clock_skew_s: float = 5.0,
    max_lifetime_s: float = 3600.0,
) -> None:
    """Accept (return None) or raise a :class:`CredentialError` subclass.

    The MAC is compared in constant time; expiry and lifetime are checked only after the
    MAC, so an unauthenticated caller learns nothing about the namespace from the reason.
    """
    if not credential:
        raise MissingCredential("request carries no credential for its namespace")
    expected = make_credential(namespace_key, request_id, deadline, content)
    if not isinstance(credential, bytes | bytearray) or len(credential) != CREDENTIAL_BYTES:
        raise ForgedCredential(f"credential is not {CREDENTIAL_BYTES} bytes")
    if not hmac.compare_digest(expected, bytes(credential)):
        raise ForgedCredential(
            "credential does not match the request content (id, deadline, prompt, sampling "
            "and other settings) under this namespace's key: the request was changed after "
            "it was signed, or signed with another secret")
    if now > float(deadline) + clock_skew_s:
        raise ExpiredCredential(f"deadline passed {now - float(deadline):.1f} s ago")
    if float(deadline) - now > max_lifetime_s:
        raise CredentialTooLong(
            f"deadline is {float(deadline) - now:.0f} s ahead, more than {max_lifetime_s:.0f} s"
        )


def _type_name(value: object) -> str:
    return {
        str: "a string", int: "an integer", float: "a float", bool: "a boolean",
        list: "a list", dict: "a table",
    }.get(type(value), type(value).__name__)
