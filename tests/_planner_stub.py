"""A planner cache view over fixed facts, for pure-logic planner tests."""

from __future__ import annotations

from prefixmesh.overlay.core.digest import LoadFigures
from prefixmesh.overlay.core.planner import ViewAnswer


class StubView:
    """A full-replication view over fixed facts (pure-logic unit test)."""

    def __init__(self, matches):
        self.matches = matches

    def known(self, ns, chain, now, carried=None):
        return ViewAnswer(dict(self.matches), (), "index")

    def load_of(self, peer):
        return LoadFigures(0, 0, 500.0, 100.0)

    def vouches(self, peer):
        return True

    def namespace_holders(self, ns):
        return set(self.matches)

    def known_peers(self):
        return list(self.matches)
