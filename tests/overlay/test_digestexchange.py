"""The one interface of the two digest exchanges (overlay/digestexchange.py): both variants
implement it, take their tunables from one ExchangeSettings, and report their counters the
way Node.stats() names them. (Their network behaviour: test_gossip_limits.py,
test_partition_node.py, test_infer.py.)"""

from __future__ import annotations

import dataclasses

import pytest

from prefixmesh.overlay.core.antientropy import AntiEntropy
from prefixmesh.overlay.core.identity import Identity
from prefixmesh.overlay.core.partition import PartitionConfig, PartitionedDigest
from prefixmesh.overlay.core.peerindex import PeerCacheIndex
from prefixmesh.overlay.digestexchange import DigestExchange, ExchangeSettings
from prefixmesh.overlay.gossip import Gossip
from prefixmesh.overlay.partgossip import PartitionGossip

MODEL = b"model-fp-test-00"
NOW = 1_700_000_000.0
# constructing either variant touches no host: a round or handler would
NO_HOST = None


def _ae(seed: bytes = b"\x01" * 32) -> AntiEntropy:
    return AntiEntropy(Identity.from_seed(seed), MODEL, epoch=1, now=NOW)


def _gossip(**kw) -> Gossip:
    return Gossip(NO_HOST, _ae(), PeerCacheIndex(), peers=lambda: [], **kw)


def _pgossip(**kw) -> PartitionGossip:
    ident = Identity.from_seed(b"\x02" * 32)

    def make_stream(fp: bytes, now: float) -> AntiEntropy:
        return AntiEntropy(ident, fp, epoch=1, now=now, ttl=900.0, refresh_interval=300.0)

    pd = PartitionedDigest(ident, MODEL, config=PartitionConfig(n_partitions=4, replicas=1),
                           make_stream=make_stream)  # fmt: skip
    return PartitionGossip(NO_HOST, pd, peers=lambda: [], **kw)


def test_both_variants_implement_the_interface():
    for exchange in (_gossip(), _pgossip()):
        assert isinstance(exchange, DigestExchange), type(exchange).__name__
    # the interface names only what both offer
    members = {n for n in dir(DigestExchange) if not n.startswith("_")}
    for cls in (Gossip, PartitionGossip):
        assert members <= set(dir(cls)) | {"stats", "rounds", "last_heard"}, cls


def test_one_settings_value_configures_either_variant():
    s = ExchangeSettings(interval_s=2.5, byte_budget=4096, exchange_timeout_s=7.0, fanout=5,
                         bucket_summaries=True, exchange_rate_per_s=3.0, exchange_burst=9.0,
                         request_rate_per_s=10.0, request_burst=20.0, stream_idle_s=4.0)
    g, pg = _gossip(settings=s), _pgossip(settings=s)
    assert g.settings == pg.settings == s
    assert (g.interval_s, g.byte_budget, g.exchange_timeout_s) == (2.5, 4096, 7.0)
    assert (pg.interval_s, pg.byte_budget, pg.exchange_timeout_s) == (2.5, 4096, 7.0)
    assert g.fanout == 5 and g.bucket_summaries is True
    assert g.max_message_bytes == 2 * 4096 + 256 * 1024  # the derived default
    assert (g.exchange_limiter.rate_per_s, g.exchange_limiter.burst) == (3.0, 9.0)
    assert (pg.limiter.rate_per_s, pg.limiter.burst, pg.stream_idle_s) == (10.0, 20.0, 4.0)


def test_keyword_overrides_replace_single_fields_and_unknown_ones_are_refused():
    g = _gossip(settings=ExchangeSettings(fanout=5), byte_budget=1024)
    assert g.settings == dataclasses.replace(ExchangeSettings(), fanout=5, byte_budget=1024)
    assert _gossip().settings == ExchangeSettings()  # the defaults
    with pytest.raises(TypeError):
        _gossip(fanuot=2)
    with pytest.raises(TypeError):
        _pgossip(request_rate=2.0)
    with pytest.raises(ValueError, match="max_exchanges_per_peer"):
        _gossip(max_exchanges_per_peer=0)


def test_advertised_hash_is_the_summary_hash_or_nothing():
    g = _gossip()
    assert g.advertised_hash() == b""  # before the first tick
    g._rehash()
    assert g.advertised_hash() == g.ae.summary_digest() != b""
    assert _pgossip().advertised_hash() == b""  # one stream per partition: no single hash


def test_node_stats_are_prefixed_per_variant():
    g = _gossip()
    g.stats["exchanges_ok"] += 3
    g.rounds = 7
    assert g.node_stats() == {"digest_exchanges_ok": 3, "digest_rounds": 7}
    pg = _pgossip()
    pg.stats["pushes_ok"] += 2
    pg.rounds = 4
    out = pg.node_stats()
    assert out["part_pushes_ok"] == 2 and out["part_rounds"] == 4
    assert out["part_streams"] == len(pg.pd.streams)
    assert out["part_lookup_cache_hits"] == out["part_lookup_cache_misses"] == 0
    assert all(k.startswith("part_") for k in out)
