"""Reachability verdicts and hole punching of real ``prefixmesh node`` processes (the real
model, default settings) in the NAT lab (issue 16; bench/natlab.py).

Two public nodes R1, R2 (each in a namespace of its own on the lab's public bridge) and
three homes behind their own NAT routers (routers that silently drop unsolicited SYNs, as
most home routers do): A and B behind endpoint-independent, port-preserving NATs (Linux
``masquerade``), C behind a symmetric one (``random,fully-random``). Every home bootstraps
from R1 and R2. What is checked, from each node's own log:

* R1 and R2 come to ``public`` (peers dialled them back), A and B to ``private`` behind a
  ``port-preserving`` NAT, C to ``private`` behind a ``symmetric`` one;
* hole punching runs at A and B and not at C;
* A and B end with a direct (hole-punched) connection to each other: the punch between
  two port-preserving NATs succeeds.

Timing is recorded, never asserted: with ``PREFIXMESH_NAT_FIGURES=FILE`` the seconds from
spawn to each verdict and the punch counts per NAT type go there as JSON
(docs/bench/nat.md). Needs root and nft; skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
from _swarm import NodeProc, wait_until

from prefixmesh.bench.natlab import lab_unavailable_reason

REASON = lab_unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

PORT = 4001
PUBLIC_IPS = ("198.18.0.21", "198.18.0.22")
FIGURES = os.environ.get("PREFIXMESH_NAT_FIGURES_REACHABILITY")
VERDICT = re.compile(r"reachability: (public|private|unknown), NAT (\S+)")
PUNCH = re.compile(r"hole punch to (\S+?):? (direct connection|failed)")


def _log(node: NodeProc) -> str:
    try:
        return node.log_path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _verdict(node: NodeProc) -> tuple[str, str] | None:
    """The node's latest settled verdict (kind, NAT kind) from its log."""
    found = [m.groups() for m in VERDICT.finditer(_log(node)) if m.group(1) != "unknown"]
    return found[-1] if found else None


def _punches(node: NodeProc) -> list[tuple[str, bool]]:
    return [(m.group(1), m.group(2) == "direct connection") for m in PUNCH.finditer(_log(node))]


def test_verdicts_and_hole_punching_per_nat_type(tmp_path):
    from prefixmesh.bench.nat_probe import Scenario

    with Scenario(homes_nat=("eim", "eim", "symmetric"), public_hosts=1,
                  routers_drop=True) as sc:
        nodes: dict[str, NodeProc] = {}
        spawned: dict[str, float] = {}
        try:
            pubs = [sc.extra_public_ns(ip) for ip in PUBLIC_IPS]
            for name, ns, ip, boot in (("R1", pubs[0], PUBLIC_IPS[0], []),):
                nodes[name] = NodeProc(tmp_path, name, netns=ns, listen=f"/ip4/{ip}/tcp/{PORT}",
                                       bootstrap=boot)
                spawned[name] = time.monotonic()
                nodes[name].start()
            r1 = f"/ip4/{PUBLIC_IPS[0]}/tcp/{PORT}/p2p/{nodes['R1'].peer_b58}"
            nodes["R2"] = NodeProc(tmp_path, "R2", netns=pubs[1],
                                   listen=f"/ip4/{PUBLIC_IPS[1]}/tcp/{PORT}", bootstrap=[r1])
            spawned["R2"] = time.monotonic()
            nodes["R2"].start()
            boot = [r1, f"/ip4/{PUBLIC_IPS[1]}/tcp/{PORT}/p2p/{nodes['R2'].peer_b58}"]
            for name, home in zip("ABC", sc.lab.homes, strict=True):
                nodes[name] = NodeProc(tmp_path, name, netns=home.ns,
                                       listen=f"/ip4/{home.ip}/tcp/{PORT}", bootstrap=boot)
                spawned[name] = time.monotonic()
                nodes[name].launch()
            for name in "ABC":
                nodes[name].wait_ready()

            want = {"R1": ("public", None), "R2": ("public", None),
                    "A": ("private", "port-preserving"), "B": ("private", "port-preserving"),
                    "C": ("private", "symmetric")}
            verdict_s: dict[str, float] = {}
            for name, (kind, nat) in want.items():
                got = wait_until(lambda n=name: _verdict(nodes[n]), timeout_s=120,
                                 interval_s=0.5, what=f"{name}'s reachability verdict")
                verdict_s[name] = round(time.monotonic() - spawned[name], 1)
                assert got[0] == kind, (name, got, _log(nodes[name])[-3000:])
                if nat is not None:
                    assert got[1] == nat, (name, got, _log(nodes[name])[-3000:])
            for name in "AB":
                wait_until(lambda n=name: "hole punching on" in _log(nodes[n]), timeout_s=30,
                           what=f"hole punching at {name}")
            assert "hole punching on" not in _log(nodes["C"])

            peer_of = {nodes[n].peer_b58[-12:]: n for n in nodes}
            wait_until(lambda: any(ok and peer_of.get(p) in "AB"
                                   for n in "AB" for p, ok in _punches(nodes[n])),
                       timeout_s=180, interval_s=1.0, what="a hole punch between A and B")
            # figures only: let each EIM home's auto-drive also try the other homes (the
            # symmetric one declines at once: it does not run DCUtR); not asserted, so a
            # plain run does not wait for it (up to 30 s)
            def tried_both(n: str) -> bool:
                others = {peer_of.get(p) for p, _ in _punches(nodes[n])}
                return {"AB".replace(n, ""), "C"} <= others
            if FIGURES:
                try:
                    wait_until(lambda: all(tried_both(n) for n in "AB"), timeout_s=30,
                               interval_s=1.0, what="punch outcomes towards every other home")
                except AssertionError:
                    pass
            per_type: dict[str, list[int]] = {}
            for n in "AB":
                for p, ok in _punches(nodes[n]):
                    other = peer_of.get(p, "?")
                    kind = {"A": "eim", "B": "eim", "C": "symmetric"}.get(other, "public")
                    tally = per_type.setdefault(f"eim->{kind}", [0, 0])
                    tally[0] += ok
                    tally[1] += 1
            assert per_type["eim->eim"][0] >= 1
            if FIGURES:
                Path(FIGURES).write_text(json.dumps({
                    "seconds_from_spawn_to_verdict": verdict_s,
                    "hole_punches_success_of_attempts": per_type,
                    "verdicts": {n: _verdict(nodes[n]) for n in nodes},
                }, indent=2) + "\n")
        finally:
            for n in nodes.values():
                n.kill()
