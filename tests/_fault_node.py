"""Test-only node entry point: ``python tests/_fault_node.py <prefixmesh node flags>``.

Runs :func:`prefixmesh.node.daemon.main` unchanged, except that with
``PREFIXMESH_FAULT=wrong-tokens`` the engine is wrapped in :class:`WrongTokensBackend`:
fault injection lives with the tests that need it, not in the serving path
(``tests/_swarm.py`` starts every node through this file).
"""

from __future__ import annotations

import contextlib
import os

from prefixmesh.inference.backend import TokenChunk
from prefixmesh.node import daemon


class WrongTokensBackend:
    """A Backend that alters every token it generates ('#' before each piece, ids + 1):
    a peer that answers with the wrong model or tampers with its output."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    async def generate(self, request):
        async with contextlib.aclosing(self._inner.generate(request)) as events:
            async for ev in events:
                if isinstance(ev, TokenChunk):
                    ev = TokenChunk("#" + ev.text, tuple(t + 1 for t in ev.token_ids))
                yield ev


def main() -> int:
    if os.environ.get("PREFIXMESH_FAULT") == "wrong-tokens":
        make = daemon._make_backend
        daemon._make_backend = lambda config, options: WrongTokensBackend(make(config, options))
    return daemon.main()


if __name__ == "__main__":
    raise SystemExit(main())
