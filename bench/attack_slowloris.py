"""The slowloris attacks of issue 14 (finding 2) against one node process, any code tree.

    .venv/bin/python bench/attack_slowloris.py [--pythonpath DIR] [--duration 60]
    prefixmesh bench attack-slowloris [--pythonpath DIR] [--duration 60]

Starts one node with the simulated engine (as ``bench/attack_digest_flood.py`` does; with
``--pythonpath DIR`` the tree in ``DIR/prefixmesh``, e.g. an older commit unpacked with
``git archive C | tar -x -C DIR/prefixmesh``), then:

1. *unattacked*: 20 sequential honest requests, each on a new connection (a new
   identity, so no history with the node);
2. *attacked*: in a separate attacker process (``tests/adversary/slowloris.py``),
   identities x streams on each of infer, digest, peers and swim, plus an infer flood
   of more identities x 64 streams, each stream announcing a 512 KiB frame
   and trickling one byte every 2-5 s, reopened whenever the node cuts it (the sizes are
   flags; the defaults are issue 14's attack: 5 identities x 64 infer streams, one byte
   every 5 s, plus 2 identities x 4 streams on each other protocol; the attacker
   process runs at ``--nice`` 10, as if on its own machine: this 2-core machine is
   shared); after ``--settle`` seconds (10),
   20 sequential honest requests, and a fresh connection + peers query every 2 s for
   the whole attack ("still accepting connections");
3. *after*: once the attacker process has exited, honest requests until one is answered
   within 2x the unattacked median: the time from the attack's end to that answer.

Prints one line of figures (JSON). ``tests/swarm/test_attack_slowloris.py`` asserts the
behaviour on the current tree; this script gives the figures in docs/SECURITY.md (D20).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

N_REQUESTS = 20


async def _honest(addr: str, timeout_s: float = 20.0) -> float | str:
    from prefixmesh.node.client import Client

    t0 = time.perf_counter()
    try:
        with trio.fail_after(timeout_s):
            async with Client.connect(addr) as c:
                await c.ask([("user", "hello")], max_tokens=2)
        return time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - a figure, not a crash
        return f"{type(exc).__name__}: {exc}"[:120]


async def _probe(addr: str) -> bool:
    """A new connection and a peers query (the node still accepts connections)."""
    from prefixmesh.node.client import Client

    try:
        with trio.fail_after(10):
            async with Client.connect(addr) as c:
                await c.peers()
        return True
    except Exception:  # noqa: BLE001
        return False


def _attacker_cmd(addr: str, args: argparse.Namespace) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--attacker", addr,
            "--duration", str(args.duration), "--flood-identities", str(args.flood_identities),
            "--identities", str(args.identities), "--streams", str(args.streams),
            "--nice", str(args.nice)]


async def _attack(addr: str, args: argparse.Namespace) -> dict:
    from adversary.slowloris import slowloris

    out: dict = {}

    async def one(key: str, **kw) -> None:
        out[key] = await slowloris(addr, duration_s=args.duration, **kw)

    async with trio.open_nursery() as nursery:
        if args.identities:
            nursery.start_soon(lambda: one(
                "slowloris", protocols=["infer", "digest", "peers", "swim"],
                identities=args.identities, streams=args.streams, gap_s=2.0))
        if args.flood_identities:
            nursery.start_soon(lambda: one("infer_flood", protocols=["infer"],
                                           identities=args.flood_identities, streams=64,
                                           gap_s=5.0))
    return out


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the node process has used so far."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


async def run(addr: str, pid: int, args: argparse.Namespace) -> dict:
    cpu0, t0 = _cpu_s(pid), time.monotonic()
    quiet = [await _honest(addr) for _ in range(N_REQUESTS)]
    cpu_quiet = (_cpu_s(pid) - cpu0) / (time.monotonic() - t0)
    quiet_ok = [x for x in quiet if isinstance(x, float)]
    attacker = await trio.lowlevel.open_process(_attacker_cmd(addr, args),
                                                stdout=subprocess.PIPE)
    t_attack = time.monotonic()
    probes: list[bool] = []

    async def probe_loop() -> None:
        while True:
            probes.append(await _probe(addr))
            await trio.sleep(2.0)

    attacked: list[float | str] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(probe_loop)
        await trio.sleep(args.settle)  # let the attack take hold
        cpu0 = _cpu_s(pid)
        for _ in range(N_REQUESTS):
            attacked.append(await _honest(addr))
        t_honest_done = time.monotonic() - t_attack
        cpu_attacked = (_cpu_s(pid) - cpu0) / max(1e-9, time.monotonic() - t_attack - args.settle)
        out = b""
        async with attacker.stdout:
            while chunk := await attacker.stdout.receive_some(65536):
                out += chunk
        await attacker.wait()
        nursery.cancel_scope.cancel()
    t_end = time.monotonic()
    limit = 2 * statistics.median(quiet_ok) if quiet_ok else 1.0
    recovery: float | None = None
    while time.monotonic() - t_end < 30.0:
        x = await _honest(addr)
        if isinstance(x, float) and x <= limit:
            recovery = time.monotonic() - t_end
            break
    ok = [x for x in attacked if isinstance(x, float)]
    attack_figs = json.loads(out.decode() or "{}")
    return {
        "quiet_answered": len(quiet_ok),
        "quiet_median_s": round(statistics.median(quiet_ok), 4) if quiet_ok else None,
        "attacked_answered": len(ok), "attacked_of": len(attacked),
        "attacked_median_s": round(statistics.median(ok), 4) if ok else None,
        "ratio": (round(statistics.median(ok) / statistics.median(quiet_ok), 2)
                  if ok and quiet_ok else None),
        "failures": sorted({x for x in attacked if not isinstance(x, float)})[:5],
        "honest_done_at_s": round(t_honest_done, 1),
        "node_cpu_quiet": round(cpu_quiet, 2), "node_cpu_attacked": round(cpu_attacked, 2),
        "probes_ok": sum(probes), "probes": len(probes),
        "recovery_s": round(recovery, 2) if recovery is not None else None,
        "attack": attack_figs,
    }


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--pythonpath", default=None,
                    help="run the node from DIR/prefixmesh (an older tree, for before/after)")
    ap.add_argument("--duration", type=float, default=60.0,
                    help="seconds the attack lasts (default 60)")
    ap.add_argument("--flood-identities", type=int, default=5,
                    help="identities opening 64 trickled infer streams each (default 5)")
    ap.add_argument("--identities", type=int, default=2,
                    help="identities trickling on infer, digest, peers and swim (default 2)")
    ap.add_argument("--streams", type=int, default=4,
                    help="streams per protocol of each of those (default 4)")
    ap.add_argument("--settle", type=float, default=10.0,
                    help="seconds of attack before the honest requests (default 10)")
    ap.add_argument("--nice", type=int, default=10,
                    help="niceness of the attacker process (default 10; this machine is "
                    "shared, and a real attacker's CPU is its own)")
    ap.add_argument("--attacker", default=None, help=argparse.SUPPRESS)


def run_bench_attack_slowloris(args: argparse.Namespace) -> int:
    if args.attacker:  # the attacker process: niced, as if on the attacker's own machine
        os.nice(args.nice)
        print(json.dumps(trio.run(_attack, args.attacker, args)))
        return 0
    from prefixmesh.bench.attack_nodes import spawn_node

    root = Path(tempfile.mkdtemp(prefix="attack-"))
    proc, addr = spawn_node(root, pythonpath=args.pythonpath)
    try:
        figures = trio.run(run, addr, proc.pid, args)
        figures["alive"] = proc.poll() is None
    finally:
        proc.kill()
    figures["log"] = str(root / "node.log")
    print(json.dumps(figures))
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    sys.exit(run_bench_attack_slowloris(ap.parse_args()))


if __name__ == "__main__":
    main()
