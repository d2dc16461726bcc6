"""Test-only node entry point: ``python tests/_fault_node.py --config FILE [harness flags]``.

Starts a node exactly as the benchmark entry point does (``bench/node_entry.py``: the
config file, then the launcher's ``run_node``, the same harness flags), except that the
environment variable ``PREFIXMESH_FAULT`` wraps the engine in a misbehaving Backend, so
that swarm tests can show the defences work (``tests/_swarm.py`` starts every node through
this file). Fault injection lives with the tests that need it, not in the serving path:

- ``wrong-tokens``: :class:`WrongTokensBackend` ("#" before every chunk, token ids + 1);
- ``lie-digest``: :class:`LieDigestBackend`: the node advertises in its digest the block
  hashes of every prompt listed in the JSON file named by ``PREFIXMESH_FAULT_PROMPTS`` (a
  list of message lists, ``[[["system", "..."], ...], ...]``), in every namespace it
  serves, without holding them.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from prefixmesh.bench import node_entry
from prefixmesh.inference.backend import CacheEvent, TokenChunk
from prefixmesh.inference.core.blocks import BLOCK_TOKENS, chain_hashes
from prefixmesh.node import launch, process


class _Wrapping:
    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


class WrongTokensBackend(_Wrapping):
    """A Backend that alters every token it generates ('#' before each piece, ids + 1):
    a peer that answers with the wrong model or tampers with its output."""

    async def generate(self, request):
        async with contextlib.aclosing(self._inner.generate(request)) as events:
            async for ev in events:
                if isinstance(ev, TokenChunk):
                    ev = TokenChunk("#" + ev.text, tuple(t + 1 for t in ev.token_ids))
                yield ev


class LieDigestBackend(_Wrapping):
    """A Backend that reports, as cache "add" events, the prefixes of ``prompts`` (message
    lists) in every namespace registered with it, and never holds them: the daemon then
    advertises them in its digest like real cache contents (a peer that lies about its
    cache to attract requests)."""

    def __init__(self, inner, prompts) -> None:
        super().__init__(inner)
        self._prompts = tuple(prompts)
        self._tokens: list[tuple[int, ...]] = []
        self._lies: list[CacheEvent] = []

    async def load(self) -> None:
        await self._inner.load()
        # tokenized once here: register_namespace (which needs them) is not async
        self._tokens = [await self._inner.tokenize(list(m)) for m in self._prompts]

    def register_namespace(self, name: str, key: bytes, ns_id: bytes) -> None:
        self._inner.register_namespace(name, key, ns_id)
        for tokens in self._tokens:
            chain = chain_hashes(key, tokens, BLOCK_TOKENS)
            if chain:
                self._lies.append(CacheEvent("add", ns_id, tuple(chain)))

    def drain_cache_events(self) -> list[CacheEvent]:
        lies, self._lies = self._lies, []
        return lies + self._inner.drain_cache_events()


def load_prompts(path: str) -> tuple:
    """The message lists of a ``PREFIXMESH_FAULT_PROMPTS`` file."""
    if not path:
        return ()
    return tuple(tuple((str(r), str(c)) for r, c in msgs)
                 for msgs in json.loads(Path(path).read_text()))


def main(argv: list[str] | None = None) -> int:
    fault = os.environ.get("PREFIXMESH_FAULT", "")
    make = process.make_backend
    if fault == "wrong-tokens":
        process.make_backend = lambda config, options: WrongTokensBackend(make(config, options))
    elif fault == "lie-digest":
        prompts = load_prompts(os.environ.get("PREFIXMESH_FAULT_PROMPTS", ""))
        process.make_backend = lambda config, options: LieDigestBackend(
            make(config, options), prompts)
    elif fault:
        raise SystemExit(f"_fault_node.py: unknown PREFIXMESH_FAULT {fault!r}")
    if fault:
        launch.log.warning("TEST-ONLY FAULT INJECTION ACTIVE: %s", fault)
    return node_entry.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
