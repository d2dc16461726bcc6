"""Benchmark-only node entry point: ``python -m prefixmesh.bench.node_entry <daemon flags>``.

Runs :func:`prefixmesh.node.daemon.main` unchanged, except that ``--policy NAME`` may
also name a baseline of ``bench/policies.py`` (``paper``, ``round-robin``, ...): the
node's own config accepts only deployable policies, so the flag is taken out of the
arguments here and the daemon's policy factory builds the named one instead.
``bench/swarm.py`` starts its nodes through this file.
"""

from __future__ import annotations

import sys

from prefixmesh.node import daemon

from .policies import POLICY_NAMES, make_policy


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--policy" in args:
        i = args.index("--policy")
        if i + 1 >= len(args) or args[i + 1] not in POLICY_NAMES:
            print(f"node_entry: --policy needs one of {', '.join(POLICY_NAMES)}",
                  file=sys.stderr)
            return 2
        name = args[i + 1]
        del args[i : i + 2]
        daemon.make_policy = lambda _name, config, rng, self_id: make_policy(
            name, config, rng, self_id)
    return daemon.main(args)


if __name__ == "__main__":
    raise SystemExit(main())
