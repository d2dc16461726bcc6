"""node/tenants.py: tenant parsing, namespace separation, request credentials."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.inference.core.blocks import chain_hashes, derive_namespace_key, namespace_id
from prefixmesh.node.tenants import (
    CREDENTIAL_BYTES,
    DEFAULT_PUBLIC_TENANT,
    CredentialTooLong,
    ExpiredCredential,
    ForgedCredential,
    MissingCredential,
    Tenant,
    TenantConfigError,
    TenantError,
    TenantRegistry,
    TenantSpec,
    check_credential,
    default_tenant_specs,
    make_credential,
    parse_tenant,
    public_secret,
)
from prefixmesh.overlay.core.identity import Identity

FP_A = b"model-a-fingerprint"
FP_B = b"model-b-fingerprint"
SECRET = "correct horse battery staple"
PEER = Identity.from_seed(bytes(range(32)))


def private(name: str = "acme", secret: str = SECRET) -> TenantSpec:
    return parse_tenant(name, {"secret": secret})


def secret_file(tmp_path: Path, content: bytes, mode: int = 0o600) -> Path:
    p = tmp_path / "tenant.secret"
    p.write_bytes(content)
    p.chmod(mode)
    return p


# --- parsing ----------------------------------------------------------------------------


def test_private_inline_secret():
    spec = private()
    assert spec.visibility == "private" and spec.secret == SECRET.encode()
    assert SECRET not in repr(spec)


def test_secret_file_relative_to_base_dir(tmp_path):
    secret_file(tmp_path, b"  file-secret-of-acme-0123  \n")
    spec = parse_tenant("acme", {"secret_file": "tenant.secret"}, base_dir=tmp_path)
    assert spec.secret == b"  file-secret-of-acme-0123"  # trailing whitespace only
    assert spec.secret_file == tmp_path / "tenant.secret"


@pytest.mark.parametrize(
    ("content", "mode", "problem"),
    [
        (b"x" * 32, 0o640, "readable by group or others"),
        (b"x" * 32, 0o604, "readable by group or others"),
        (b"\n  \n", 0o600, "file is empty"),
        (b"short", 0o600, "fewer than 16"),
    ],
)
def test_bad_secret_file(tmp_path, content, mode, problem):
    p = secret_file(tmp_path, content, mode)
    with pytest.raises(TenantConfigError) as info:
        parse_tenant("acme", {"secret_file": str(p)})
    assert str(info.value).startswith("[tenants.acme].secret_file: ")
    assert problem in str(info.value)


def test_missing_and_non_regular_secret_file(tmp_path):
    with pytest.raises(TenantConfigError, match="file not found"):
        parse_tenant("acme", {"secret_file": str(tmp_path / "nope")})
    with pytest.raises(TenantConfigError, match="not a regular file"):
        parse_tenant("acme", {"secret_file": str(tmp_path)})


@pytest.mark.parametrize(
    ("table", "problem"),
    [
        ({}, "needs secret or secret_file"),
        ({"secret": SECRET, "secret_file": "x"}, "not both"),
        ({"secret": "short"}, "at least 16"),
        ({"secret": ""}, "is empty"),
        ({"secret": 12345678901234567}, "must be a string"),
        ({"visibility": "protected", "secret": SECRET}, '"protected" is not one of'),
        ({"visibility": "public", "secret": SECRET}, "well-known secret"),
        ({"secret": SECRET, "allowed_peers": ["nope"]}, "is not a peer id"),
        ({"secret": SECRET, "allowed_peers": "12D3KooW"}, "must be a list"),
        ({"secret": SECRET, "colour": "red"}, "unknown key"),
    ],
)
def test_bad_tenant_tables(table, problem):
    with pytest.raises(TenantConfigError, match=problem):
        parse_tenant("acme", table)


def test_bad_tenant_name():
    with pytest.raises(TenantConfigError, match="tenant name"):
        parse_tenant("-acme", {"secret": SECRET})


def test_public_tenant_and_default():
    spec = parse_tenant("sys", {"visibility": "public"})
    assert spec.secret == public_secret("sys") and spec.public
    (default,) = default_tenant_specs()
    assert default.name == DEFAULT_PUBLIC_TENANT == "public" and default.public
    # anyone can compute a public namespace's id from its name alone
    key = derive_namespace_key(public_secret("sys"), "sys", FP_A)
    assert Tenant.derive(spec, FP_A).ns_id == namespace_id(key)


# --- key separation ---------------------------------------------------------------------


def test_namespace_separation():
    tokens = list(range(64))
    tenants = [
        Tenant.derive(private("acme"), FP_A),
        Tenant.derive(private("acme"), FP_B),  # same tenant, other model
        Tenant.derive(private("acme", SECRET + "!"), FP_A),  # other secret
        Tenant.derive(private("globex"), FP_A),  # same secret, other name
        Tenant.derive(parse_tenant("acme", {"visibility": "public"}), FP_A),  # public
    ]
    ids = {t.ns_id for t in tenants}
    keys = {t.namespace_key for t in tenants}
    chains = {tuple(chain_hashes(t.namespace_key, tokens)) for t in tenants}
    assert len(ids) == len(keys) == len(chains) == len(tenants)
    # deterministic: a client and a node derive the same id from the same config
    assert Tenant.derive(private("acme"), FP_A).ns_id == tenants[0].ns_id


def test_registry_lookup_and_allowed_peers():
    acme = parse_tenant("acme", {"secret": SECRET, "allowed_peers": [PEER.peer_id_b58]})
    reg = TenantRegistry.from_specs([acme, *default_tenant_specs()], FP_A)
    t = reg.by_name("acme")
    assert t is not None and reg.lookup(t.ns_id) is t and t.ns_id in reg
    assert t.may_serve(PEER.peer_id) and not t.may_serve(Identity.generate().peer_id)
    assert reg.by_name("public").may_serve(Identity.generate().peer_id)
    # a namespace this node is not configured for: relay only
    other = Tenant.derive(private("acme", SECRET + "?"), FP_A)
    assert reg.lookup(other.ns_id) is None and other.ns_id not in reg
    assert sorted(reg.names()) == ["acme", "public"] and len(reg) == 2
    with pytest.raises(TenantError, match="twice"):
        TenantRegistry.from_specs([acme, acme], FP_A)


# --- credentials ------------------------------------------------------------------------

NOW = 1_800_000_000.0
RID = b"\x01" * 16
C = b"\x07" * 32  # a content digest (overlay/core/reqdigest.py)


def test_credential_accepts():
    key = Tenant.derive(private(), FP_A).namespace_key
    cred = make_credential(key, RID, NOW + 30, C)
    assert len(cred) == CREDENTIAL_BYTES
    check_credential(key, RID, NOW + 30, cred, content=C, now=NOW)
    check_credential(key, RID, NOW + 30.0, bytearray(cred), content=C,
                     now=NOW + 32)  # within skew


def test_credential_missing():
    key = Tenant.derive(private(), FP_A).namespace_key
    for cred in (None, b""):
        with pytest.raises(MissingCredential):
            check_credential(key, RID, NOW + 30, cred, content=C, now=NOW)


def test_credential_forged():
    acme = Tenant.derive(private(), FP_A)
    cred = acme.credential(RID, NOW + 30, C)
    other = Tenant.derive(private("acme", SECRET + "!"), FP_A)
    cases = [
        (acme.namespace_key, RID, NOW + 30, other.credential(RID, NOW + 30, C)),  # wrong secret
        (acme.namespace_key, b"\x02" * 16, NOW + 30, cred),  # other request
        (acme.namespace_key, RID, NOW + 31, cred),  # deadline moved
        (acme.namespace_key, RID, NOW + 30, cred[:-1]),  # truncated
        (acme.namespace_key, RID, NOW + 30, bytes(32)),
        (acme.namespace_key, RID, NOW + 30, acme.ns_id),  # the public id is not a credential
    ]
    for key, rid, deadline, c in cases:
        with pytest.raises(ForgedCredential):
            check_credential(key, rid, deadline, c, content=C, now=NOW)


def test_credential_expired_and_too_long():
    t = Tenant.derive(private(), FP_A)
    with pytest.raises(ExpiredCredential):
        t.check(RID, NOW - 10, t.credential(RID, NOW - 10, C), content=C, now=NOW)
    with pytest.raises(ExpiredCredential):
        t.check(RID, NOW, t.credential(RID, NOW, C), content=C, now=NOW + 1, clock_skew_s=0.5)
    with pytest.raises(CredentialTooLong):
        t.check(RID, NOW + 7200, t.credential(RID, NOW + 7200, C), content=C, now=NOW)
    t.check(RID, NOW + 7200, t.credential(RID, NOW + 7200, C), content=C, now=NOW,
            max_lifetime_s=7200)


def test_expiry_is_checked_after_the_mac():
    # a forger must not learn anything from the reason: a bad MAC is "forged" even if late
    t = Tenant.derive(private(), FP_A)
    with pytest.raises(ForgedCredential):
        t.check(RID, NOW - 100, bytes(32), content=C, now=NOW)


@settings(max_examples=200)
@given(
    rid=st.binary(min_size=0, max_size=64),
    deadline=st.floats(min_value=0, max_value=4e9, allow_nan=False),
    flip=st.integers(min_value=0, max_value=CREDENTIAL_BYTES * 8 - 1),
)
def test_credential_properties(rid, deadline, flip):
    key = Tenant.derive(private(), FP_A).namespace_key
    cred = make_credential(key, rid, deadline, C)
    check_credential(key, rid, deadline, cred, content=C, now=deadline)
    bad = bytearray(cred)
    bad[flip // 8] ^= 1 << (flip % 8)
    with pytest.raises(ForgedCredential):
        check_credential(key, rid, deadline, bytes(bad), content=C, now=deadline)


def test_credential_binds_request_id_length():
    # (rid, deadline) framing is unambiguous: a longer id cannot absorb deadline bytes
    key = Tenant.derive(private(), FP_A).namespace_key
    assert make_credential(key, b"ab", 1.0, C) != make_credential(key, b"a", 1.0, C)
    assert make_credential(key, RID, 5, C) == make_credential(key, RID, 5.0, C)


def test_credential_binds_the_request_content():
    """Issue 14, finding 3: a relay may change only the relay fields of a signed request."""
    from dataclasses import replace

    from prefixmesh.overlay.core import wire

    t = Tenant.derive(private(), FP_A)
    req = t.sign(wire.Request(id=RID, ns=t.ns_id, tokens=(1, 2, 3), deadline=NOW + 30,
                              sampling=wire.Sampling(max_tokens=8)))
    t.check_request(req, now=NOW)
    hop = wire.Hop(peer=b"p" * 38, action="forward", reason="x")
    relayed = replace(req, hop_budget=0, visited=(b"p" * 38,), trace=(hop,),
                      holders=((b"q" * 38, 2),))
    t.check_request(relayed, now=NOW)  # what relays legitimately change
    rewritten = [
        replace(req, tokens=(1, 2, 4)),
        replace(req, messages=(wire.Message("user", "hi"),)),
        replace(req, sampling=wire.Sampling(max_tokens=9)),
        replace(req, sampling=wire.Sampling(max_tokens=8, temperature=1.5)),
        replace(req, stream=False),
        replace(req, grammar='root ::= "yes"'),
        replace(req, logprobs=3),
    ]
    for bad in rewritten:
        with pytest.raises(ForgedCredential, match="does not match the request content"):
            t.check_request(bad, now=NOW)
    with pytest.raises(TenantError, match="content digest"):
        make_credential(t.namespace_key, RID, NOW, b"short")


def test_credential_binds_a_raw_prompt_for_another_model():
    """Issue 18: a raw-prompt completion travels as text to a node of its model; a relay
    (a node of another model) cannot change the text, the model, or swap in tokens."""
    from dataclasses import replace

    from prefixmesh.overlay.core import wire

    t = Tenant.derive(private(), FP_A)
    req = t.sign(wire.Request(id=RID, ns=t.ns_id, prompt="Once upon a time", model=FP_A,
                              deadline=NOW + 30))
    t.check_request(req, now=NOW)
    for bad in (replace(req, prompt="Once upon a crime"), replace(req, model=b"\x01" * 16),
                replace(req, prompt="", tokens=(1, 2, 3))):
        with pytest.raises(ForgedCredential, match="does not match the request content"):
            t.check_request(bad, now=NOW)
