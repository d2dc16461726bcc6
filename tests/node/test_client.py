"""The light client against an in-process node (simulated engine): the CLI adapters
(`open_client_for_cli`, `chat_send`, `peers_report`), the local address file, and errors."""

from __future__ import annotations

import pytest
import trio

from prefixmesh.node.chat_cli import TurnStats
from prefixmesh.node.client import Client, ConnectFailed, open_client_for_cli
from prefixmesh.node.config import load_config
from prefixmesh.node.daemon import Node, NodeOptions
from prefixmesh.overlay.core.identity import Identity


def _node(tmp_path):
    cfg = load_config(None, {"node.cache_dir": str(tmp_path / "cache"), "node.mdns": False,
                             "node.key_file": str(tmp_path / "k")})
    return cfg, Node(cfg, NodeOptions(backend="sim", dht=False, print_addrs=False),
                     identity=Identity.generate())


def test_cli_adapters_and_local_address_file(tmp_path):
    async def main():
        cfg, node = _node(tmp_path)
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            # no --peer: the client finds the node through <cache_dir>/node.addrs
            assert (tmp_path / "cache" / "node.addrs").read_text().split()[0] == node.full_addrs()[0]
            async with open_client_for_cli(cfg) as client:
                assert client.peer_b58 == node.identity.peer_id_b58
                send = client.chat_send(8)
                items = [x async for x in send([{"role": "user", "content": "hello there"}])]
                pieces, stats = items[:-1], items[-1]
                assert pieces and all(isinstance(p, str) for p in pieces)
                assert isinstance(stats, TurnStats)
                assert stats.served_by == node.identity.peer_id_b58 and stats.hops == 0
                assert stats.completion_tokens == 8 and len(stats.route) == 1
                report = await client.peers_report()
                assert report["self"] == node.identity.peer_id_b58
                assert report["stats"]["infer_requests"] == 1
            await node.shutdown(grace_s=0.2)

    trio.run(main)


def test_connect_errors_are_clear(tmp_path):
    async def main():
        with pytest.raises(ConnectFailed, match="bad peer address"):
            async with Client.connect("/ip4/127.0.0.1/tcp/1"):
                pass
        nobody = Identity.generate().peer_id_b58
        with pytest.raises(ConnectFailed, match="cannot reach"):
            async with Client.connect(f"/ip4/127.0.0.1/tcp/1/p2p/{nobody}", timeout_s=3):
                pass
        cfg, _ = _node(tmp_path)
        # mDNS off in this config: no LAN browsing (the LAN's nodes must not matter)
        with pytest.raises(ConnectFailed, match=r"no --peer given.*mDNS is off"):
            async with open_client_for_cli(cfg):
                pass

    trio.run(main)


def test_address_file_removed_on_shutdown(tmp_path):
    async def main():
        cfg, node = _node(tmp_path)
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            assert (tmp_path / "cache" / "node.addrs").exists()
            await node.shutdown(grace_s=0.1)
        assert not (tmp_path / "cache" / "node.addrs").exists()

    trio.run(main)
