"""The digest-flood attack of issue 14 (finding 1) against one node process, any code tree.

    .venv/bin/python bench/attack_digest_flood.py [--pythonpath DIR] [--window 30]

Starts one node with the simulated engine (``prefixmesh.bench.node_entry --config FILE
--backend sim``; with ``--pythonpath DIR``, the tree in ``DIR/prefixmesh``, e.g. an older
commit unpacked with ``git archive C | tar -x -C DIR/prefixmesh``, through that tree's own
``python -m prefixmesh.node.daemon`` flags), sends 20 honest requests (each on a new
connection), then runs the outside attacker of ``tests/adversary/digest_flood.py`` (1,100
fresh-identity snapshot records naming 127.0.0.2..9, twice) during 20 more, counts TCP
connections at those addresses for ``--window`` seconds, and prints one line of figures
(JSON). The test ``tests/swarm/test_attack_digest_flood.py`` asserts the bounds on the
current tree; this script gives the before/after comparison in docs/SECURITY.md (D19).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from adversary.digest_flood import flood  # noqa: E402

from prefixmesh.bench.attack_nodes import (  # noqa: E402
    count_dials,
    honest_request,
    rss_mib,
    spawn_node,
)


def start_node(pythonpath: str | None) -> tuple[subprocess.Popen, str, Path]:
    """One node with the simulated engine in a fresh temporary directory (its log there)."""
    root = Path(tempfile.mkdtemp(prefix="attack-"))
    proc, addr = spawn_node(root, pythonpath=pythonpath)
    return proc, addr, root


async def run(proc: subprocess.Popen, addr: str, window_s: float) -> dict:
    dials: list[float] = []
    async with trio.open_nursery() as nursery:
        foreign = await nursery.start(count_dials, dials)
        rss0 = rss_mib(proc.pid)
        quiet = [await honest_request(addr) for _ in range(20)]
        t0 = time.monotonic()
        await flood(addr, foreign)
        attacked = []
        for i in range(20):
            if i == 10:
                try:
                    await flood(addr, foreign)
                except Exception as exc:  # the victim may be gone already
                    attacked.append(f"flood failed: {type(exc).__name__}")
            attacked.append(await honest_request(addr))
        while time.monotonic() - t0 < window_s:
            await trio.sleep(0.5)
        elapsed = time.monotonic() - t0
        after = await honest_request(addr)
        nursery.cancel_scope.cancel()
    ok = [x for x in attacked if isinstance(x, float)]
    quiet_ok = [x for x in quiet if isinstance(x, float)]
    return {
        "quiet_answered": len(quiet_ok), "quiet_median_s": statistics.median(quiet_ok),
        "attacked_answered": len(ok),
        "attacked_median_s": statistics.median(ok) if ok else None,
        "failures": sorted({x for x in attacked if not isinstance(x, float)}),
        "foreign_dials": len(dials), "window_s": round(elapsed, 1),
        "dials_per_min": round(len(dials) * 60 / elapsed, 1),
        "rss_mib": [rss0, rss_mib(proc.pid)], "after": after,
        "alive": proc.poll() is None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pythonpath", default=None)
    ap.add_argument("--window", type=float, default=30.0)
    args = ap.parse_args()
    proc, addr, root = start_node(args.pythonpath)
    try:
        figures = trio.run(run, proc, addr, args.window)
    finally:
        proc.kill()
    figures["log"] = str(root / "node.log")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
