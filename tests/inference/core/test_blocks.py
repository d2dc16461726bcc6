"""Chained block hashes: prefix property, namespace separation, validation."""

import hashlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.inference.core.blocks import (
    BLOCK_TOKENS,
    HASH_BYTES,
    ROOT_HASH,
    blocks_in,
    chain_hashes,
    derive_namespace_key,
    extend_chain,
    namespace_id,
)

FP = b"model-fingerprint"
KEY_A = derive_namespace_key(b"secret-a", "tenant-a", FP)
KEY_B = derive_namespace_key(b"secret-b", "tenant-b", FP)

tokens_st = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=200)


@given(tokens_st, tokens_st)
@settings(max_examples=200)
def test_prefix_property(a, b):
    """The hashes of a sequence's prefix are a prefix of its hashes."""
    full = chain_hashes(KEY_A, a + b)
    head = chain_hashes(KEY_A, a)
    whole_blocks = len(a) // BLOCK_TOKENS
    assert full[:whole_blocks] == head[:whole_blocks]
    assert len(full) == blocks_in(len(a) + len(b))
    assert all(len(h) == HASH_BYTES for h in full)


@given(tokens_st)
@settings(max_examples=200)
def test_incremental_extension_matches_full_chain(tokens):
    cut = (len(tokens) // BLOCK_TOKENS // 2) * BLOCK_TOKENS
    head = chain_hashes(KEY_A, tokens[:cut])
    prev = head[-1] if head else ROOT_HASH
    assert head + extend_chain(KEY_A, prev, tokens[cut:]) == chain_hashes(KEY_A, tokens)


@given(tokens_st, st.integers(1, 40))
@settings(max_examples=200)
def test_chain_is_its_definition(tokens, block_tokens):
    """h_i = blake2b_8(h_{i-1} || uint32le(block i), key=namespace key): what the nodes
    exchange, so the one-pack, copied-state implementation must compute exactly this."""
    prev, want = ROOT_HASH, []
    for b in range(len(tokens) // block_tokens):
        block = tokens[b * block_tokens : (b + 1) * block_tokens]
        data = prev + struct.pack(f"<{block_tokens}I", *block)
        prev = hashlib.blake2b(data, key=KEY_A, digest_size=HASH_BYTES).digest()
        want.append(prev)
    assert extend_chain(KEY_A, ROOT_HASH, tokens, block_tokens) == want


@given(st.lists(st.integers(0, 50_000), min_size=BLOCK_TOKENS, max_size=64))
@settings(max_examples=200)
def test_namespaces_are_unlinkable(tokens):
    """The same tokens hash to disjoint values under different namespace keys."""
    a = set(chain_hashes(KEY_A, tokens))
    b = set(chain_hashes(KEY_B, tokens))
    assert a and not (a & b)


def test_divergence_changes_every_later_hash():
    base = list(range(64))
    other = list(base)
    other[20] += 1  # inside block 1
    ha, hb = chain_hashes(KEY_A, base), chain_hashes(KEY_A, other)
    assert ha[0] == hb[0]
    assert all(x != y for x, y in zip(ha[1:], hb[1:], strict=True))


def test_partial_block_is_not_hashed():
    assert chain_hashes(KEY_A, list(range(BLOCK_TOKENS - 1))) == []
    assert len(chain_hashes(KEY_A, list(range(BLOCK_TOKENS * 2 + 5)))) == 2


def test_key_derivation_depends_on_every_input():
    keys = {
        derive_namespace_key(b"s", "n", FP),
        derive_namespace_key(b"s2", "n", FP),
        derive_namespace_key(b"s", "n2", FP),
        derive_namespace_key(b"s", "n", FP + b"x"),
    }
    assert len(keys) == 4
    assert namespace_id(KEY_A) != namespace_id(KEY_B)
    assert len(namespace_id(KEY_A)) == HASH_BYTES


@pytest.mark.parametrize(
    "call",
    [
        lambda: derive_namespace_key(b"", "n", FP),
        lambda: derive_namespace_key(b"s", "", FP),
        lambda: derive_namespace_key(b"s", "n", b""),
        lambda: chain_hashes(b"short", [1] * 16),
        lambda: chain_hashes(KEY_A, [-1] * 16),
        lambda: chain_hashes(KEY_A, [2**32] * 16),
        lambda: extend_chain(KEY_A, b"\x00", [1] * 16),
        lambda: blocks_in(10, 0),
    ],
)
def test_bad_input_raises_value_error(call):
    with pytest.raises(ValueError):
        call()
