"""The NAT lab: a small internet of network namespaces with real NAT routers.

Volunteers run nodes at home behind NAT; this lab lets tests and benchmarks put real node
processes in that position on one machine (root needed; ``ip`` from iproute2 and ``nft``
from nftables)::

      "public" namespace: bridge br0, 198.18.0.0/24 (RFC 2544's benchmarking range)
      |  public hosts: 198.18.0.1, .2, ... (bootstrap and relay nodes run here)
      |
      +-- router rK: wan 198.18.0.(100+K)  --NAT--  lan 10.77.K.1/24
                                                      |
                                                 home hK: 10.77.K.2 (default route: rK)

A router masquerades what leaves its WAN side. ``"eim"`` is Linux ``masquerade``: the
mapping keeps the source port where it can and does not depend on the destination
(endpoint-independent, what hole punching needs). ``"symmetric"`` adds
``random,fully-random``: every new destination gets a random port (address-and-port-
dependent mapping, where hole punching fails and only a relay helps). Nothing forwards
inbound connections, so the public side cannot connect to a home. The kernel here has no
``netem``: delay belongs in the application (as bench/swarm.py does).

Only addresses inside the lab's own namespaces are ever used; :meth:`NatLab.close`
deletes every namespace it made (their veths and the bridge go with them), and a lab
left behind by a killed run is removed by the next one with the same prefix.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["NatLab", "Home", "lab_unavailable_reason", "NAT_TYPES"]

NAT_TYPES = ("eim", "symmetric")
PUBLIC_NET = "198.18.0"
HOME_NET = "10.77"


def lab_unavailable_reason() -> str | None:
    """Why the lab cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "the NAT lab needs root (network namespaces)"
    for tool, pkg in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"the NAT lab needs '{tool}' (Debian package {pkg})"
    probe = f"pmprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass(frozen=True)
class Home:
    index: int
    nat: str  # "eim" | "symmetric"
    ns: str  # the home's namespace
    router_ns: str
    ip: str  # the home host's private address
    wan_ip: str  # its router's public address: what the public side sees


@dataclass
class NatLab:
    homes_nat: Sequence[str] = ("eim", "eim", "symmetric")
    public_hosts: int = 2
    prefix: str = field(default_factory=lambda: f"pm{os.getpid() % 100000}")
    homes: list[Home] = field(default_factory=list, init=False)
    _made: list[str] = field(default_factory=list, init=False)

    @property
    def public_ns(self) -> str:
        return f"{self.prefix}-pub"

    def public_ip(self, i: int) -> str:
        """The address of public host ``i`` (0-based)."""
        if not 0 <= i < self.public_hosts:
            raise IndexError(f"public host {i} of {self.public_hosts}")
        return f"{PUBLIC_NET}.{i + 1}"

    # --- set-up and tear-down -------------------------------------------------------

    def __enter__(self) -> NatLab:
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        for nat in self.homes_nat:
            if nat not in NAT_TYPES:
                raise ValueError(f"unknown NAT type {nat!r} (one of {NAT_TYPES})")
        self._remove_leftovers()
        try:
            self._make_public()
            for k, nat in enumerate(self.homes_nat, start=1):
                self.homes.append(self._make_home(k, nat))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()
        self.homes.clear()

    def _remove_leftovers(self) -> None:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            name = line.split()[0] if line.split() else ""
            if name.startswith(self.prefix + "-"):
                subprocess.run(["ip", "netns", "del", name], capture_output=True)

    def _ns(self, name: str) -> str:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")
        return name

    def _make_public(self) -> None:
        pub = self._ns(self.public_ns)
        _ip("-n", pub, "link", "add", "br0", "type", "bridge")
        _ip("-n", pub, "link", "set", "br0", "up")
        for i in range(self.public_hosts):
            _ip("-n", pub, "addr", "add", f"{self.public_ip(i)}/24", "dev", "br0")

    def _make_home(self, k: int, nat: str) -> Home:
        pub = self.public_ns
        router = self._ns(f"{self.prefix}-r{k}")
        home = self._ns(f"{self.prefix}-h{k}")
        wan_ip, lan_gw, home_ip = f"{PUBLIC_NET}.{100 + k}", f"{HOME_NET}.{k}.1", \
            f"{HOME_NET}.{k}.2"
        # WAN: router <-> public bridge
        _ip("link", "add", f"{self.prefix}w{k}", "netns", router, "type", "veth", "peer",
            "name", f"{self.prefix}p{k}", "netns", pub)
        _ip("-n", router, "link", "set", f"{self.prefix}w{k}", "name", "wan")
        _ip("-n", pub, "link", "set", f"{self.prefix}p{k}", "master", "br0", "up")
        _ip("-n", router, "addr", "add", f"{wan_ip}/24", "dev", "wan")
        _ip("-n", router, "link", "set", "wan", "up")
        # LAN: router <-> home
        _ip("link", "add", f"{self.prefix}l{k}", "netns", router, "type", "veth", "peer",
            "name", f"{self.prefix}h{k}", "netns", home)
        _ip("-n", router, "link", "set", f"{self.prefix}l{k}", "name", "lan")
        _ip("-n", home, "link", "set", f"{self.prefix}h{k}", "name", "eth0")
        _ip("-n", router, "addr", "add", f"{lan_gw}/24", "dev", "lan")
        _ip("-n", router, "link", "set", "lan", "up")
        _ip("-n", home, "addr", "add", f"{home_ip}/24", "dev", "eth0")
        _ip("-n", home, "link", "set", "eth0", "up")
        _ip("-n", home, "route", "add", "default", "via", lan_gw)
        _run(["ip", "netns", "exec", router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
        flags = " random,fully-random" if nat == "symmetric" else ""
        rules = (
            "table ip nat {\n"
            " chain post { type nat hook postrouting priority 100; policy accept;\n"
            f'  oifname "wan" masquerade{flags}\n'
            " }\n}\n"
        )
        _run(["ip", "netns", "exec", router, "nft", "-f", "-"], input=rules)
        return Home(k, nat, home, router, home_ip, wan_ip)

    # --- running things inside ------------------------------------------------------

    def command(self, ns: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside namespace ``ns``."""
        if ns not in self._made:
            raise ValueError(f"{ns} is not a namespace of this lab")
        return ["ip", "netns", "exec", ns, *argv]

    def popen(self, ns: str, argv: Sequence[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(self.command(ns, argv), **kw)

    def run(self, ns: str, argv: Sequence[str], *, timeout: float = 30.0, **kw):
        return subprocess.run(self.command(ns, argv), timeout=timeout, capture_output=True,
                              text=True, **kw)


class LabError(RuntimeError):
    """A lab set-up command failed (the message holds the command and its stderr)."""


def _run(argv: list[str], input: str | None = None) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, input=input)
    if r.returncode != 0:
        raise LabError(f"{' '.join(argv)}: {r.stderr.strip() or r.stdout.strip()}")


def _ip(*args: str) -> None:
    _run(["ip", *args])
