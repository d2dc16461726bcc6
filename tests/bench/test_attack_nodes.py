"""bench/attack_nodes.py, what the attack benchmarks share: a node process started from its
config (one real node, simulated engine, ~3 s), an honest request to it (a latency) and to
nothing (a reason, never an exception), its memory and descriptors from /proc, and the
dial counters at the foreign loopback addresses."""

from __future__ import annotations

import os
import socket

import trio

from prefixmesh.bench import attack_nodes


def test_rss_and_fds_of_a_live_and_of_a_gone_process():
    rss, fds = attack_nodes.rss_mib(os.getpid()), attack_nodes.open_fds(os.getpid())
    assert rss is not None and rss > 1 and fds is not None and fds >= 3
    pid = 2**22 + 1  # above Linux's pid_max: no such process
    assert attack_nodes.rss_mib(pid) is None and attack_nodes.open_fds(pid) is None


def test_count_dials_counts_every_connection_at_every_foreign_address():
    async def main():
        dials: list[float] = []
        async with trio.open_nursery() as nursery:
            addrs = await nursery.start(attack_nodes.count_dials, dials)
            assert [a.split("/")[2] for a in addrs] == attack_nodes.FOREIGN_IPS
            for a in addrs[:3]:
                _, _, ip, _, port = a.split("/")
                stream = await trio.open_tcp_stream(ip, int(port))
                await stream.aclose()
            with trio.fail_after(5):
                while len(dials) < 3:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        assert len(dials) == 3

    trio.run(main)


def test_spawned_node_answers_an_honest_request_and_nothing_else_does(tmp_path):
    proc, addr = attack_nodes.spawn_node(tmp_path / "node")
    try:
        assert addr.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in addr
        assert (tmp_path / "node" / "node.toml").is_file()
        latency = trio.run(attack_nodes.honest_request, addr)
        assert isinstance(latency, float) and latency > 0, latency
        assert attack_nodes.rss_mib(proc.pid) > 1
    finally:
        proc.kill()
        proc.wait()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = addr.replace(addr.split("/")[4], str(port))
    failed = trio.run(lambda: attack_nodes.honest_request(dead, timeout_s=5.0))
    assert isinstance(failed, str) and failed
