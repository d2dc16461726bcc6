"""The combined soak of issue 14: every outside attack at once against a small mesh.

    prefixmesh bench attack-soak [--minutes 10] [--nodes 3] [--backend llama|sim]

Starts ``--nodes`` real node processes (``prefixmesh.bench.node_entry`` with a config
file each, the first the others' bootstrap peer; ``--backend llama``: the embedded
model), then runs three phases while an honest client sends requests one after the other
to a random node, each on a new connection with a fresh identity (``max_tokens`` 4):

1. *unattacked*, ``--quiet-s`` seconds;
2. *attacked*, ``--minutes``: a separate attacker process (outsider code from
   ``tests/adversary/``) runs at the same time the digest flood with foreign addresses
   (1,100 fresh-identity records naming 127.0.0.2..9, at a random node every 60 s),
   slowloris on infer/digest/peers/swim at the first node (3 identities x 8 streams,
   plus 8 identities x 64 infer streams), 200 Sybil identities holding connections to
   the last node and 2 identities looping PEERS queries at it;
3. *after*, ``--quiet-s`` seconds once the attacker process has exited.

Every 10 s it samples each node's RSS and open file descriptors (``/proc``) and counts
TCP connections reaching the foreign addresses (counting listeners stand there). Prints
one JSON document and a Markdown table (answered / sent, p50, p99 per phase; RSS and fds
per node over time): docs/SECURITY.md, docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from prefixmesh.bench.attack_nodes import (
    count_dials,
    honest_request,
    open_fds,
    rss_mib,
    spawn_node,
)

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_EVERY_S = 10.0
ATTACKS = ("flood", "slowloris", "sybil")
FLOOD_EVERY_S = 60.0


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--minutes", type=float, default=10.0,
                    help="length of the attacked phase (default 10)")
    ap.add_argument("--quiet-s", type=float, default=60.0,
                    help="length of the unattacked phase and of the after phase (default 60)")
    ap.add_argument("--nodes", type=int, default=3, help="node processes (default 3)")
    ap.add_argument("--attacks", default=",".join(ATTACKS),
                    help=f"which attacks, comma-separated (default all: {','.join(ATTACKS)})")
    ap.add_argument("--backend", choices=("llama", "sim"), default="llama",
                    help="the nodes' engine: the embedded model (default) or simulated")
    ap.add_argument("--seed", type=int, default=0, help="the honest client's choices")
    ap.add_argument("--attacker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--foreign", default=None, help=argparse.SUPPRESS)


# --- nodes ------------------------------------------------------------------------------


def _proc_sample(pid: int) -> tuple[float | None, int | None]:
    return rss_mib(pid), open_fds(pid)


# --- the attacker process ---------------------------------------------------------------


async def _attack(addrs: list[str], foreign: list[str], duration_s: float,
                  attacks: frozenset[str] = frozenset(ATTACKS)) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from adversary.digest_flood import flood
    from adversary.slowloris import slowloris
    from adversary.sybil import connection_flood, peers_flood

    out: dict = {"floods": 0, "flood_failures": 0}
    conns: dict = {}
    peers: dict = {}
    rng = random.Random(1)

    async def floods() -> None:
        while True:
            try:
                await flood(rng.choice(addrs), foreign)
                out["floods"] += 1
            except Exception:  # the victim refused or cut us: that is its defence
                out["flood_failures"] += 1
            await trio.sleep(FLOOD_EVERY_S)

    async def slow(key: str, **kw) -> None:
        out[key] = await slowloris(addrs[0], duration_s=duration_s, **kw)

    async def endless() -> None:  # the attacks that run until told to stop
        with trio.move_on_after(duration_s):
            async with trio.open_nursery() as nursery:
                if "flood" in attacks:
                    nursery.start_soon(floods)
                if "sybil" in attacks:
                    nursery.start_soon(connection_flood, addrs[-1], 200, conns)
                    nursery.start_soon(peers_flood, addrs[-1], 2, peers)
                await trio.sleep_forever()

    async with trio.open_nursery() as nursery:  # slowloris stops by itself, with figures
        nursery.start_soon(endless)
        if "slowloris" in attacks:
            nursery.start_soon(lambda: slow("slowloris", protocols=[
                "infer", "digest", "peers", "swim"], identities=3, streams=8))
            nursery.start_soon(lambda: slow("infer_slots", protocols=["infer"], identities=8,
                                            streams=64, gap_s=5.0))
    out.update(sybil=conns, peers_flood=peers)
    return out


# --- the honest client and the phases ---------------------------------------------------


async def _honest(addr: str) -> float | str:
    return await honest_request(addr, timeout_s=30.0, prompt="Name a colour.", max_tokens=4)


def _phase(results: list[float | str]) -> dict:
    ok = sorted(x for x in results if isinstance(x, float))
    return {
        "sent": len(results), "answered": len(ok),
        "p50_s": round(statistics.median(ok), 3) if ok else None,
        "p99_s": round(ok[min(len(ok) - 1, int(0.99 * len(ok)))], 3) if ok else None,
        "failures": sorted({x for x in results if not isinstance(x, float)})[:5],
    }


async def _run(procs: list[subprocess.Popen], addrs: list[str], args) -> dict:
    rng = random.Random(args.seed)
    dials: list[float] = []
    samples: list[dict] = []
    t0 = time.monotonic()

    async def sampler() -> None:
        while True:
            row: dict = {"t_s": round(time.monotonic() - t0, 1), "foreign_dials": len(dials)}
            for i, p in enumerate(procs):
                row[f"n{i}"] = _proc_sample(p.pid)
            samples.append(row)
            await trio.sleep(SAMPLE_EVERY_S)

    async def honest_for(seconds: float) -> list[float | str]:
        out: list[float | str] = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            out.append(await _honest(rng.choice(addrs)))
        return out

    phases: dict = {}
    async with trio.open_nursery() as nursery:
        foreign = await nursery.start(count_dials, dials)
        nursery.start_soon(sampler)
        phases["unattacked"] = _phase(await honest_for(args.quiet_s))
        duration_s = args.minutes * 60.0
        cmd = [sys.executable, "-m", "prefixmesh.bench.attack_soak", "--attacker",
               ",".join(addrs), "--foreign", ",".join(foreign), "--minutes", str(args.minutes),
               "--attacks", args.attacks]
        attacker = await trio.lowlevel.open_process(cmd, stdout=subprocess.PIPE)
        t_attack = time.monotonic()
        attacked = await honest_for(duration_s)
        raw = b""
        async with attacker.stdout:
            while chunk := await attacker.stdout.receive_some(65536):
                raw += chunk
        await attacker.wait()
        phases["attacked"] = _phase(attacked)
        attack_s = time.monotonic() - t_attack
        dials_in_attack = len(dials)
        phases["after"] = _phase(await honest_for(args.quiet_s))
        nursery.cancel_scope.cancel()
    return {
        "nodes": len(procs), "backend": args.backend, "minutes": args.minutes,
        "attacks": args.attacks,
        "phases": phases,
        "foreign_dials_per_min": round(dials_in_attack * 60.0 / max(attack_s, 1.0), 1),
        "alive": [p.poll() is None for p in procs],
        "samples": samples,
        "attack": json.loads(raw.decode() or "{}"),
    }


def _table(fig: dict) -> str:
    lines = ["| phase | answered / sent | p50 s | p99 s | p50 vs unattacked |",
             "|---|---|---|---|---|"]
    base = fig["phases"]["unattacked"]["p50_s"]
    for name, ph in fig["phases"].items():
        ratio = (f"{ph['p50_s'] / base:.2f}x" if ph["p50_s"] and base else "-")
        lines.append(f"| {name} | {ph['answered']} / {ph['sent']} | {ph['p50_s']} | "
                     f"{ph['p99_s']} | {ratio} |")
    lines += ["", "| t (s) | foreign dials | " + " | ".join(
        f"node {i} RSS MiB / fds" for i in range(fig["nodes"])) + " |",
        "|---|---|" + "---|" * fig["nodes"]]
    for row in fig["samples"][:: max(1, len(fig["samples"]) // 12)]:
        cells = [f"{row[f'n{i}'][0]:.0f} / {row[f'n{i}'][1]}" if row[f"n{i}"][0] else "-"
                 for i in range(fig["nodes"])]
        lines.append(f"| {row['t_s']} | {row['foreign_dials']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_bench_attack_soak(args: argparse.Namespace) -> int:
    if args.attacker:  # the attacker process
        print(json.dumps(trio.run(_attack, args.attacker.split(","), args.foreign.split(","),
                                  args.minutes * 60.0, frozenset(args.attacks.split(",")))))
        return 0
    unknown = set(args.attacks.split(",")) - set(ATTACKS)
    if args.nodes < 1 or args.minutes <= 0 or args.quiet_s <= 0 or unknown:
        print("attack-soak: --nodes must be >= 1, --minutes and --quiet-s > 0, --attacks "
              f"among {','.join(ATTACKS)}" + (f" (unknown: {','.join(sorted(unknown))})"
                                               if unknown else ""), file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="soak-"))
    procs: list[subprocess.Popen] = []
    addrs: list[str] = []
    try:
        for i in range(args.nodes):
            proc, addr = spawn_node(root / f"n{i}", backend=args.backend, bootstrap=addrs[:1])
            procs.append(proc)
            addrs.append(addr)
        time.sleep(5.0)  # the mesh forms (bootstrap, first digests)
        figures = trio.run(_run, procs, addrs, args)
    finally:
        for p in procs:
            p.kill()
    figures["logs"] = str(root)
    print(json.dumps(figures))
    print(_table(figures))
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    sys.exit(run_bench_attack_soak(ap.parse_args()))


if __name__ == "__main__":
    main()
