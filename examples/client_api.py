"""Ask a prefixmesh network one question from Python, with the client API (node/client.py).

    python examples/client_api.py --peer /ip4/127.0.0.1/tcp/4001/p2p/12D3KooW... \
        --system "You are a terse assistant." "What is a KV cache?"

    # a private tenant (namespace) from a config file with [tenants.NAME]:
    python examples/client_api.py --peer ADDR --config examples/tenants.toml --tenant acme "hi"

The client is light: it has its own throw-away identity, serves nothing and talks to one
entry node, which routes the request to whichever node holds the longest cached prefix of
the prompt (possibly itself). Tokens are printed as they stream in; then the route trace
(one line per node the request passed through, with the routing decision's reason) and
the statistics of the FINAL frame. Errors are ``ClientError`` subclasses with a one-line
message (``ConnectFailed``, ``RequestFailed`` with the node's error code, ...).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time

import trio

from prefixmesh.node.client import Client, ClientError
from prefixmesh.overlay.core import wire
from prefixmesh.overlay.core.identity import peer_id_to_b58


def short(peer: bytes) -> str:
    b58 = peer_id_to_b58(peer)
    return f"{b58[:8]}…{b58[-6:]}"


def print_route(final: wire.Final) -> None:
    print("route:")
    for i, hop in enumerate(final.hops):
        target = f" -> {short(hop.next_peer)}" if hop.next_peer else ""
        print(f"  {i + 1}. {short(hop.peer)} {hop.action}{target}: {hop.reason}")
        print(f"     local match {hop.local_matched_tokens} tokens, decided in "
              f"{hop.decide_ms:.1f} ms, first token after {hop.ttft_ms:.0f} ms")


def print_stats(final: wire.Final, ttft_s: float, total_s: float) -> None:
    print("stats:")
    print(f"  entry node    {short(final.entry)}")
    print(f"  served by     {short(final.serving)}")
    print(f"  prompt tokens {final.prompt_tokens} ({final.cached_tokens} from a KV cache)")
    print(f"  answer tokens {final.completion_tokens} (finish: {final.finish_reason})")
    print(f"  TTFT {ttft_s:.2f} s, total {total_s:.2f} s (measured here); "
          f"the server's TTFT {final.ttft_ms:.0f} ms")


async def ask(peer: str, prompt: str, *, system: str | None, max_tokens: int,
              tenant=None) -> None:
    messages = [("system", system)] if system else []
    messages.append(("user", prompt))
    async with Client.connect(peer) as client:
        reply = await client.peers()  # the node's view of the network (and its model)
        print(f"connected to {short(client.peer)}, which knows {len(reply.peers)} peer(s)\n")
        t0 = time.perf_counter()
        ttft_s = float("nan")
        final: wire.Final | None = None
        # aclosing: leaving the loop early (Ctrl-C, an exception) cancels the request
        async with contextlib.aclosing(
            client.stream(messages, tenant=tenant, max_tokens=max_tokens)
        ) as items:
            async for item in items:
                if isinstance(item, str):  # a piece of the answer
                    if ttft_s != ttft_s:  # NaN: the first piece
                        ttft_s = time.perf_counter() - t0
                    print(item, end="", flush=True)
                else:  # the FINAL frame: statistics and the route trace
                    final = item
        total_s = time.perf_counter() - t0
        print("\n")
        assert final is not None  # stream() always ends with FINAL or raises
        print_route(final)
        print_stats(final, ttft_s, total_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer", required=True, metavar="MULTIADDR",
                   help="entry node, /ip4/HOST/tcp/PORT/p2p/PEER_ID (printed by `prefixmesh node`)")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--config", help="TOML file with [tenants.NAME] tables")
    p.add_argument("--tenant", help="tenant (namespace) name from --config (default: public)")
    p.add_argument("prompt", nargs="+")
    args = p.parse_args(argv)
    # py-libp2p logs every failed dial attempt; the one-line ClientError says it better
    for noisy in ("libp2p", "multiaddr"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)

    tenant = None
    if args.tenant:
        from prefixmesh.node.config import load_config

        tenant = load_config(args.config).tenant(args.tenant)
        if tenant is None:
            p.error(f"tenant {args.tenant!r} is not configured in {args.config}")
    try:
        trio.run(lambda: ask(args.peer, " ".join(args.prompt), system=args.system,
                             max_tokens=args.max_tokens, tenant=tenant))
    except ClientError as exc:
        print(f"error: {Client.describe_error(exc)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
