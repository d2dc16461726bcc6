"""Membership simulator: N nodes running the node's own SWIM state machine
(``overlay/core/membership.py``) over a simulated network with delay, loss, crashes and
frozen processes. Measures what docs/SCALING.md quotes: membership bytes per node per
second, time until every live node knows a node died (median, p99), and false suspicions
and false deaths per node-hour.

    python -m prefixmesh.bench.membership --nodes 64 --seconds 300 --crash-every 20
    python -m prefixmesh.bench.membership --nodes 1024 --seconds 120 --loss 0.01 --json
    python -m prefixmesh.bench.membership --nodes 32 --starve-fraction 1 --starve-delay-ms 300

CPU starvation (``--starve-fraction F --starve-delay-ms D``): a fraction F of the nodes
(chosen at the start) handle each timer and each message after an extra random wait,
exponential with mean D: what a process that gets a few % of a core sees (32 node
processes on 2 cores, docs/SCALING.md). Its timers fire late, it reads ACKs late and
answers late. The shell's lateness (how late a tick runs after the deadline it was due at,
starvation or a thaw) goes to :meth:`Membership.tick` as the node's shell passes it.
``--no-lifeguard`` runs the state machine as it was before Lifeguard (the baseline).

Event-driven: a node's ``tick`` runs only at its :meth:`Membership.next_deadline`, so
the cost is per message, not per node per time step. Bytes are the encoded CBOR messages
(``encode_message``) plus ``FRAME_OVERHEAD_BYTES`` per message for stream framing.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

from prefixmesh.overlay.core.membership import (
    ALIVE,
    DEAD,
    SUSPECT,
    Membership,
    encode_message,
)

# length prefix + Yamux frame header + Noise tag per message, roughly (bench/overlay.py
# measured ~ 40 B of overhead per small framed message on loopback)
FRAME_OVERHEAD_BYTES = 40


@dataclass
class Config:
    nodes: int = 64
    seconds: float = 300.0
    seed: int = 1
    delay_min_s: float = 0.001
    delay_max_s: float = 0.050
    loss: float = 0.0  # per-message drop probability
    crash_every_s: float = 0.0  # a random live node crashes this often (0: never)
    freeze_every_s: float = 0.0  # a random node freezes (SIGSTOP-like) this often
    freeze_s: float = 3.0  # how long a frozen node stays frozen
    warmup_s: float = 30.0  # traffic and false-positive counts start after this
    # True: every node starts knowing every other (a mesh long in steady state); False:
    # all start at once knowing only a few seeds (a cold mass start, the worst case)
    converged_start: bool = True
    lifeguard: bool = True  # False: SWIM before Lifeguard, message for message
    starve_fraction: float = 0.0  # share of nodes starved of CPU (chosen at the start)
    starve_delay_s: float = 0.0  # mean extra wait (exponential) before a starved node acts


@dataclass
class Result:
    nodes: int
    seconds: float
    bytes_per_node_s: float
    messages_per_node_s: float
    crashes: int
    detect_all_median_s: float | None
    detect_all_p99_s: float | None
    # distinct wrong claims (a member suspected or declared dead while up and not frozen),
    # however many nodes heard them
    false_suspicions_per_node_hour: float
    false_deaths_per_node_hour: float
    wall_s: float
    events: int = 0
    # first time every node held every other as a member (None: never, in the run)
    full_view_s: float | None = None
    starved: int = 0
    # the false suspicions about members that were not starved themselves
    false_suspicions_unstarved_per_node_hour: float = 0.0
    lhm_mean: float = 0.0  # Lifeguard's local health multiplier, mean over nodes and time
    # after a thaw: time until the thawed node and every other live node hold each other
    # ALIVE again (median, max over the thaws that got there; thaws that never did)
    rejoin_median_s: float | None = None
    rejoin_max_s: float | None = None
    rejoins_unfinished: int = 0
    detect_times: list[float] = field(default_factory=list, repr=False)

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d.pop("detect_times")
        return d


def _peer_id(i: int) -> bytes:
    return b"\x00\x24" + i.to_bytes(4, "big") + b"\x00" * 32  # 38 bytes, like a real id


def run(cfg: Config) -> Result:
    rng = random.Random(cfg.seed)
    ids = [_peer_id(i) for i in range(cfg.nodes)]
    members = {p: Membership(p, now=0.0, incarnation=1, rng=random.Random(rng.random()),
                             lifeguard=cfg.lifeguard)
               for p in ids}
    if cfg.converged_start:
        everyone = [u for p in ids for u in members[p].snapshot()[:1]]
        for p in ids:
            members[p].learn_state(everyone, 0.0)
    for i, p in enumerate(ids):  # everyone knows a few seeds, as bootstrap peers give
        for j in (0, 1, 2, (i + 1) % cfg.nodes):
            if ids[j] != p:
                members[p].join(ids[j], 0.0)
    sim = _Sim(cfg, rng, ids, members)
    t0 = time.perf_counter()
    sim.loop()
    return sim.result(time.perf_counter() - t0)


class _Sim:
    def __init__(self, cfg: Config, rng: random.Random, ids: list[bytes],
                 members: dict[bytes, Membership]):
        self.cfg, self.rng, self.ids, self.members = cfg, rng, ids, members
        self.heap: list = []
        self.n = 0
        self.down: set[bytes] = set()  # crashed
        self.frozen: dict[bytes, float] = {}  # frozen until
        self.crashed_at: dict[bytes, float] = {}
        self.dead_known: dict[bytes, set[bytes]] = {}  # crashed peer -> who knows it dead
        self.detect: list[float] = []
        self.detected: set[bytes] = set()
        self.knew_at_crash: dict[bytes, set[bytes]] = {}  # crashed peers every live node knows dead
        self.bytes = 0
        self.messages = 0
        self.false_suspect: set[tuple[bytes, int]] = set()  # distinct (peer, incarnation)
        self.false_dead: set[tuple[bytes, int]] = set()
        self.false_suspect_unstarved: set[tuple[bytes, int]] = set()
        self.crashes = 0
        self.events = 0
        # starvation draws from their own generator: the network's draws stay those of
        # an unstarved run with the same seed (as far as the event order allows)
        self.srng = random.Random(cfg.seed + 7919)
        k = round(cfg.starve_fraction * cfg.nodes) if cfg.starve_delay_s > 0 else 0
        self.starved: set[bytes] = set(self.srng.sample(ids, k)) if k else set()
        self.lhm_sum = 0.0
        self.lhm_samples = 0
        for p in ids:
            due = members[p].next_deadline()
            self._push(due + self._wait(p), "tick", p, due)
        if cfg.lifeguard:
            self._push(cfg.warmup_s, "sample", None)
        if cfg.crash_every_s:
            self._push(cfg.warmup_s, "crash", None)
        if cfg.freeze_every_s:
            self._push(cfg.warmup_s + cfg.freeze_every_s / 2, "freeze", None)
        self.full_view_s: float | None = None
        self._push(0.0, "check_view", None)
        self.rejoin: list[float] = []
        self.rejoining: dict[bytes, float] = {}  # thawed node -> when it thawed

    def _push(self, t: float, kind: str, node, payload=None) -> None:
        self.n += 1
        heapq.heappush(self.heap, (t, self.n, kind, node, payload))

    def loop(self) -> None:
        while self.heap:
            t, _, kind, node, payload = heapq.heappop(self.heap)
            if t > self.cfg.seconds:
                break
            self.events += 1
            getattr(self, "_on_" + kind)(t, node, payload)

    def _wait(self, node: bytes) -> float:
        """A starved node's extra wait before it runs (0 for the others)."""
        if node not in self.starved:
            return 0.0
        return self.srng.expovariate(1.0 / self.cfg.starve_delay_s)

    def _on_tick(self, t: float, node: bytes, due: float) -> None:
        if node in self.down:
            return
        if node in self.frozen:
            self._push(self.frozen[node], "tick", node, due)
            return
        m = self.members[node]
        # what the node's shell passes: how late the timer fired after its deadline
        self._deliver(t, node, m.tick(t, late_by_s=max(0.0, t - due)))
        self._observe(t, node, m)
        due = max(m.next_deadline(), t + 1e-3)
        self._push(due + self._wait(node), "tick", node, due)

    def _on_sample(self, t: float, _node, _payload) -> None:
        """Once a simulated second: the mean local health multiplier of the live nodes."""
        live = [self.members[p].local_health for p in self.ids if p not in self.down]
        self.lhm_sum += sum(live) / max(len(live), 1)
        self.lhm_samples += 1
        self._push(t + 1.0, "sample", None)

    def _on_msg(self, t: float, node: bytes, payload) -> None:
        if node in self.down:
            return
        if node in self.frozen:  # a frozen process reads its socket later
            self._push(self.frozen[node], "msg", node, payload)
            return
        sender, message = payload
        m = self.members[node]
        self._deliver(t, node, m.receive(sender, message, t))
        self._observe(t, node, m)

    def _deliver(self, t: float, sender: bytes, sends) -> None:
        for s in sends:
            if t >= self.cfg.warmup_s:
                self.bytes += len(encode_message(s.message, sender)) + FRAME_OVERHEAD_BYTES
                self.messages += 1
            if self.rng.random() < self.cfg.loss:
                continue
            delay = self.rng.uniform(self.cfg.delay_min_s, self.cfg.delay_max_s)
            self._push(t + delay + self._wait(s.to), "msg", s.to, (sender, s.message))

    def _observe(self, t: float, node: bytes, m: Membership) -> None:
        for ev in m.drain_events():
            crashed = ev.peer in self.crashed_at
            if ev.state == SUSPECT and not crashed and ev.peer not in self.frozen \
                    and t >= self.cfg.warmup_s:
                self.false_suspect.add((ev.peer, ev.incarnation))
                if ev.peer not in self.starved:
                    self.false_suspect_unstarved.add((ev.peer, ev.incarnation))
            if ev.state == DEAD and not crashed and t >= self.cfg.warmup_s:
                self.false_dead.add((ev.peer, ev.incarnation))
            if ev.state == DEAD and crashed:
                knows = self.dead_known.setdefault(ev.peer, set())
                knows.add(node)
                if ev.peer not in self.detected and self._all_know(ev.peer, knows):
                    self.detected.add(ev.peer)
                    self.detect.append(t - self.crashed_at[ev.peer])
            if ev.state == ALIVE and ev.peer in self.dead_known:
                self.dead_known[ev.peer].discard(node)

    def _all_know(self, peer: bytes, knows: set[bytes]) -> bool:
        """Whether every node still up that knew of ``peer`` when it crashed knows it dead
        (the cheap count first: the set difference only near the end)."""
        knew = self.knew_at_crash[peer]
        if len(knows) < len(knew) - len(self.down):
            return False
        return not (knew - self.down - knows)

    def _on_crash(self, t: float, _node, _payload) -> None:
        live = [p for p in self.ids if p not in self.down and p not in self.frozen]
        if len(live) > 4:
            victim = self.rng.choice(live)
            self.down.add(victim)
            self.crashed_at[victim] = t
            self.knew_at_crash[victim] = {
                p for p in self.ids if p not in self.down
                and self.members[p].state_of(victim) not in (None, DEAD)}
            self.crashes += 1
        self._push(t + self.cfg.crash_every_s, "crash", None)

    def _on_freeze(self, t: float, _node, _payload) -> None:
        live = [p for p in self.ids if p not in self.down and p not in self.frozen]
        if live:
            victim = self.rng.choice(live)
            self.frozen[victim] = t + self.cfg.freeze_s
            self._push(t + self.cfg.freeze_s, "thaw", victim)
        self._push(t + self.cfg.freeze_every_s, "freeze", None)

    def _on_check_view(self, t: float, _node, _payload) -> None:
        """Once a simulated second until every node knows every other (len is O(1))."""
        n = self.cfg.nodes - 1
        if all(len(m) >= n for m in self.members.values()):
            self.full_view_s = t
        else:
            self._push(t + 1.0, "check_view", None)

    def _on_thaw(self, t: float, node: bytes, _payload) -> None:
        self.frozen.pop(node, None)
        self.rejoining[node] = t
        self._push(t, "check_rejoin", node)

    def _on_check_rejoin(self, t: float, node: bytes, _payload) -> None:
        """Every 0.1 simulated s after a thaw, until ``node`` and every other live node
        hold each other ALIVE (a node frozen or crashed meanwhile is left out)."""
        thawed_at = self.rejoining.get(node)
        if thawed_at is None or node in self.down or node in self.frozen:
            self.rejoining.pop(node, None)
            return
        view = self.members[node]
        others = [p for p in self.ids if p != node and p not in self.down
                  and p not in self.frozen]
        if all(view.state_of(p) == ALIVE and self.members[p].state_of(node) == ALIVE
               for p in others):
            self.rejoin.append(t - thawed_at)
            del self.rejoining[node]
        else:
            self._push(t + 0.1, "check_rejoin", node)

    def result(self, wall_s: float) -> Result:
        span = max(self.cfg.seconds - self.cfg.warmup_s, 1e-9)
        live_nodes = self.cfg.nodes - len(self.down) / 2  # crashed nodes count half the time
        node_hours = live_nodes * span / 3600
        det = sorted(self.detect)
        p99 = det[min(len(det) - 1, int(0.99 * len(det)))] if det else None
        return Result(
            nodes=self.cfg.nodes, seconds=self.cfg.seconds,
            bytes_per_node_s=self.bytes / live_nodes / span,
            messages_per_node_s=self.messages / live_nodes / span,
            crashes=self.crashes,
            detect_all_median_s=statistics.median(det) if det else None,
            detect_all_p99_s=p99,
            false_suspicions_per_node_hour=len(self.false_suspect) / node_hours,
            false_deaths_per_node_hour=len(self.false_dead) / node_hours,
            wall_s=wall_s, events=self.events, full_view_s=self.full_view_s,
            starved=len(self.starved),
            false_suspicions_unstarved_per_node_hour=(
                len(self.false_suspect_unstarved) / node_hours),
            lhm_mean=self.lhm_sum / max(self.lhm_samples, 1),
            rejoin_median_s=statistics.median(self.rejoin) if self.rejoin else None,
            rejoin_max_s=max(self.rejoin) if self.rejoin else None,
            rejoins_unfinished=len(self.rejoining),
            detect_times=det,
        )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--seconds", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--delay-max", type=float, default=0.050, help="max one-way delay (s)")
    p.add_argument("--loss", type=float, default=0.0, help="message drop probability")
    p.add_argument("--crash-every", type=float, default=0.0, help="seconds between crashes")
    p.add_argument("--freeze-every", type=float, default=0.0,
                   help="seconds between SIGSTOP-like freezes")
    p.add_argument("--freeze-s", type=float, default=3.0)
    p.add_argument("--cold-start", action="store_true",
                   help="all nodes start at once knowing only a few seeds")
    p.add_argument("--starve-fraction", type=float, default=0.0,
                   help="share of nodes starved of CPU (each timer and message waits)")
    p.add_argument("--starve-delay-ms", type=float, default=0.0,
                   help="mean of a starved node's extra wait, exponential (ms)")
    p.add_argument("--no-lifeguard", action="store_true",
                   help="the state machine without Lifeguard (the baseline)")
    p.add_argument("--json", action="store_true")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixmesh.bench.membership",
                                description=__doc__.split("\n\n")[0])
    add_arguments(p)
    a = p.parse_args(argv)
    cfg = Config(nodes=a.nodes, seconds=a.seconds, seed=a.seed, delay_max_s=a.delay_max,
                 loss=a.loss, crash_every_s=a.crash_every, freeze_every_s=a.freeze_every,
                 freeze_s=a.freeze_s, converged_start=not a.cold_start,
                 lifeguard=not a.no_lifeguard, starve_fraction=a.starve_fraction,
                 starve_delay_s=a.starve_delay_ms / 1000)
    r = run(cfg)
    if a.json:
        print(json.dumps(r.to_json()))
    else:
        for k, v in r.to_json().items():
            print(f"{k:34} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
