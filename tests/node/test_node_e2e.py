"""End to end, as a user runs it: ``prefixmesh node`` processes with the REAL default model
and real libp2p on 127.0.0.1, driven through ``prefixmesh ask/peers/chat`` processes.

One three-node swarm per module (n_ctx 2048, one llama.cpp thread per node, answers of
8 tokens). Every node has its own config file, key and cache folder:

    A  tenants: public, t1 (secret file), t2 (inline secret)   (the bootstrap node)
    B  tenants: public, t1                                      bootstrap A
    C  tenants: public, t2        (no t1 secret)                bootstrap A

Waits (digest propagation, peers coming up) poll the PEERS view through the client library
in this process, not a ``prefixmesh peers`` process per poll; there are no fixed sleeps.
The bad-config tests need no swarm.
"""

from __future__ import annotations

import json
import os
import re
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import _forkserver
import pytest
import trio
from _model_fixture import TEST_THREADS, default_model_path  # noqa: E402
from _swarm import NodeProc, free_port, peers  # noqa: E402

from prefixmesh.overlay.core.identity import peer_id_to_b58  # noqa: E402
from prefixmesh.overlay.core.wire import PeerInfo  # noqa: E402

pytestmark = pytest.mark.slow  # real node processes and the real model

_SCRIPT = Path(sys.executable).parent / "prefixmesh"
CLI = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "prefixmesh"]
MAX_TOKENS = "8"
ASK_TIMEOUT_S = 120.0
PROPAGATION_TIMEOUT_S = 30.0

SHARED_SYSTEM = (
    "You are the help desk assistant of the Lighthouse Public Library. Answer in one or two "
    "short sentences. Opening hours: Monday to Friday 9:00-20:00, Saturday 10:00-16:00, "
    "closed on Sundays and public holidays. Members may borrow up to 12 items for three "
    "weeks and renew them twice online unless someone reserved them. Late returns cost 20 "
    "cents per item per day, capped at 5 euros. Membership is free for residents; visitors "
    "pay 15 euros a year. The reading room on the second floor is silent; group study rooms "
    "on the first floor can be booked for two hours a day. Printing costs 10 cents a page "
    "in black and white and 40 cents in colour. Lost cards are replaced for 2 euros."
)
T1_SECRET = "t1-secret-0123456789abcdef-not-for-t2"
T2_SECRET = "t2-secret-fedcba9876543210-not-for-t1"


# --- helpers --------------------------------------------------------------------------


def cli(*args: str, timeout: float = ASK_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    # forked from the pre-imported fork server where it can be (saves ~1.5 s of imports)
    return _forkserver.run([*CLI, *args], timeout=timeout, stdin_devnull=True)


def ask_json(entry: str, prompt: str, *, system: str | None = None,
             config: Path | None = None, tenant: str | None = None) -> dict:
    args = ["ask", "--json", "--peer", entry, "--max-tokens", MAX_TOKENS]
    if system is not None:
        args += ["--system", system]
    if config is not None:
        args += ["--config", str(config)]
    if tenant is not None:
        args += ["--tenant", tenant]
    proc = cli(*args, prompt)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["stats"] is not None, result
    return result


def peers_json(entry: str) -> dict:
    proc = cli("peers", "--json", "--peer", entry, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def peers_view(entry: str) -> dict[str, PeerInfo]:
    """peer id (base58) -> the entry node's view of that peer, through the client library
    in this process: for waits, which poll (a ``prefixmesh peers`` process costs ~2 s of
    CPU per call; what the command prints is tested in test_peers_json_lists_the_other_nodes)."""
    return {peer_id_to_b58(p.peer): p for p in peers(entry).peers}


def hashes_seen(entry: str) -> dict[str, int]:
    """peer id (base58) -> blocks the entry node believes that peer caches."""
    return {peer: p.n_hashes for peer, p in peers_view(entry).items()}


def poll(predicate, what: str, timeout_s: float = PROPAGATION_TIMEOUT_S):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; last: {last!r}")


def wait_until_known(entry: Node, holder_b58: str, min_hashes: int) -> None:
    """Poll the entry's peers view until it knows ``holder`` caches >= min_hashes blocks
    and has heard that it is idle (the entry itself needs no digest of its own cache).
    Idle too: a load figure from a probe answered while the holder was still serving the
    previous request (fresh for 5 s) prices a queue wait of a whole request on top of it,
    and under CPU load that made the entry serve locally: a correct decision on stale
    metadata, not what these routing tests check."""
    if entry.peer_b58 == holder_b58:
        return

    def known_and_idle() -> tuple[int, int, int] | None:
        p = peers_view(entry.addr).get(holder_b58)
        if p is None:
            return None
        return (p.n_hashes, p.queue_depth, p.active) if (
            p.n_hashes >= min_hashes and p.queue_depth == 0 and p.active == 0) else None

    poll(known_and_idle,
         f"{entry.name} to learn that {holder_b58[-8:]} caches >= {min_hashes} blocks and is idle")


class Node:
    """One ``prefixmesh node --config FILE`` process (via the _swarm process helper)."""

    def __init__(self, root: Path, name: str, config_text: str):
        self.name = name
        self.dir = root / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config = self.dir / "node.toml"
        self.config.write_text(config_text)
        self.proc = NodeProc(root, name)
        self.proc.args = [*CLI, "node", "--config", str(self.config)]

    def start(self) -> Node:
        self.proc.start()
        return self

    def launch(self) -> Node:
        """Start the process without waiting (``wait_ready`` waits)."""
        self.proc.launch()
        return self

    def wait_ready(self) -> Node:
        self.proc.wait_ready()
        return self

    @property
    def addr(self) -> str:
        return self.proc.addr

    @property
    def peer_b58(self) -> str:
        return self.proc.peer_b58


def node_config(name: str, root: Path, tenants: dict[str, str], bootstrap: list[str]) -> str:
    lines = [
        "[node]",
        'listen = "/ip4/127.0.0.1/tcp/0"',
        f"bootstrap = {json.dumps(bootstrap)}",
        "mdns = false",
        f'key_file = "{name}.key"',
        f'cache_dir = "{name}-kv"',
        'ram_budget = "256MiB"',
        'disk_budget = "64MiB"',
        'log_level = "info"',
        "[model]",
        f"path = {json.dumps(str(default_model_path()))}",
        "n_ctx = 2048",
        f"n_threads = {TEST_THREADS}",
        "[digest]",
        "interval_s = 0.5",
    ]
    for tenant, body in tenants.items():
        lines += [f"[tenants.{tenant}]", body]
    return "\n".join(lines) + "\n"


PUBLIC = 'visibility = "public"'
T1 = 'visibility = "private"\nsecret_file = "../t1.secret"'
T2 = f'visibility = "private"\nsecret = "{T2_SECRET}"'


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("e2e-swarm")
    secret = root / "t1.secret"
    secret.write_text(T1_SECRET + "\n")
    secret.chmod(0o600)
    nodes: list[Node] = []
    try:
        a = Node(root, "A", node_config("A", root, {"public": PUBLIC, "t1": T1, "t2": T2}, []))
        nodes.append(a.start())
        b = Node(root, "B", node_config("B", root, {"public": PUBLIC, "t1": T1}, [a.addr]))
        c = Node(root, "C", node_config("C", root, {"public": PUBLIC, "t2": T2}, [a.addr]))
        nodes += [b.launch(), c.launch()]  # both start together
        for n in nodes[1:]:
            n.wait_ready()
        for n in nodes:  # everyone sees the two others up (B and C find each other via A)
            others = {m.peer_b58 for m in nodes} - {n.peer_b58}
            poll(lambda n=n, others=others: others <= {
                peer for peer, p in peers_view(n.addr).items() if p.up},
                f"{n.name} to see the two other nodes up")
        yield nodes
    finally:
        for n in nodes:
            n.proc.terminate()
        for n in nodes:
            n.proc.kill()


@pytest.fixture(scope="module")
def client_configs(swarm, tmp_path_factory) -> dict[str, Path]:
    """Client-side tenant configs: t1 and t2 with their secrets, and t1 with a wrong one."""
    root: Path = tmp_path_factory.mktemp("clients")
    out = {}
    for name, body in (
        ("t1", f'[tenants.t1]\nsecret = "{T1_SECRET}"\n[client]\ntenant = "t1"\n'),
        ("t2", f'[tenants.t2]\nsecret = "{T2_SECRET}"\n[client]\ntenant = "t2"\n'),
        ("t1-wrong", '[tenants.t1]\nsecret = "t1-a-guessed-secret-of-the-right-length"\n'
                     '[client]\ntenant = "t1"\n'),
    ):
        out[name] = root / f"{name}.toml"
        out[name].write_text(body)
    return out


# --- three entries, one shared prefix -------------------------------------------------


def test_peers_json_lists_the_other_nodes(swarm):
    ids = {n.peer_b58 for n in swarm}
    for n in swarm:
        report = peers_json(n.addr)
        assert report["self"] == n.peer_b58
        assert n.addr in report["addrs"]
        listed = {p["peer"]: p for p in report["peers"]}
        assert set(listed) == ids - {n.peer_b58}, listed
        for p in listed.values():
            assert p["up"] and p["connected"], p
            assert p["addrs"] and all(a.startswith("/ip4/127.0.0.1/tcp/") for a in p["addrs"])


# the route follows the nodes' measured prefill rates: under another test's load a holder
# can measure slower than the forward saves, and the entry rightly serves it itself
@pytest.mark.serial
def test_shared_prefix_is_served_from_a_cache_through_each_entry_node(swarm):
    questions = ("When are you open on Saturday?",
                 "How much does it cost if I return a book four days late?",
                 "Can I book a study room for the whole afternoon?",
                 "How much do 25 colour pages cost?")
    ids = {n.peer_b58 for n in swarm}
    results = []
    holders: dict[str, int] = {}  # server -> blocks of the shared prompt it caches
    for i, question in enumerate(questions):
        entry = swarm[i % len(swarm)]
        for holder, blocks in holders.items():  # the entry has heard of earlier caches
            wait_until_known(entry, holder, blocks)
        result = ask_json(entry.addr, question, system=SHARED_SYSTEM)
        st = result["stats"]
        results.append(st)
        assert result["answer"].strip()
        assert st["entry"] == entry.peer_b58 and st["served_by"] in ids
        assert st["completion_tokens"] == int(MAX_TOKENS)
        assert st["prompt_tokens"] > 150 and st["ttft_s"] > 0
        # hops: forwards on the way (0 iff the entry served it; at most the hop budget)
        assert (st["hops"] == 0) == (st["served_by"] == entry.peer_b58), st["route"]
        assert st["hops"] <= 2 and len(st["route"]) == st["hops"] + 1, st["route"]
        if i == 0:
            assert st["cached_tokens"] == 0, st  # nobody holds the shared prompt yet
        else:
            # every later request, whichever node it enters, reuses the shared system
            # prompt (at least 8 of its ~11 blocks) from some node's cache
            assert st["cached_tokens"] >= 128, (i, st["route"], results)
        holders[st["served_by"]] = max(holders.get(st["served_by"], 0),
                                       st["prompt_tokens"] // 16 - 1)


# --- chat in a terminal ---------------------------------------------------------------


class Pty:
    """A child process on a pseudo-terminal (so chat sees a tty: prompt, colours)."""

    def __init__(self, argv: list[str]):
        master, slave = os.openpty()
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave,
                                     start_new_session=True, close_fds=True)
        os.close(slave)
        self.fd = master
        self.out = b""

    def read_until(self, pattern: re.Pattern[bytes], start: int, timeout: float
                   ) -> re.Match[bytes]:
        deadline = time.monotonic() + timeout
        while True:
            m = pattern.search(self.out, start)
            if m:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"{pattern.pattern!r} not seen; output: "
                                     f"{self.out[start:][-3000:]!r}")
            r, _, _ = select.select([self.fd], [], [], 0.2)
            if r:
                try:
                    self.out += os.read(self.fd, 65536)
                except OSError:  # EIO: the child closed the terminal
                    time.sleep(0.1)

    def write(self, data: bytes) -> None:
        os.write(self.fd, data)

    def close(self) -> int:
        try:
            return self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        finally:
            os.close(self.fd)


_ANSI = re.compile(rb"\x1b\[[0-9;]*m")
_STATS = re.compile(
    rb"served by (\S+) \xc2\xb7 (\d+) hops? \xc2\xb7 cached (\d+)/(\d+) prompt tokens "
    rb"\xc2\xb7 TTFT ([0-9.]+) s"
)


def test_chat_three_turns_in_a_terminal(swarm, tmp_path):
    entry = swarm[1]
    by_short = {f"{n.peer_b58[:8]}…{n.peer_b58[-6:]}".encode(): n.peer_b58 for n in swarm}
    client = tmp_path / "chat.toml"
    client.write_text(f'[client]\npeer = "{entry.addr}"\nmax_tokens = 16\n')
    term = Pty([*CLI, "chat", "--config", str(client)])
    try:
        at = term.read_until(re.compile(rb"> "), 0, 60).end()
        assert b"connected to" in term.out  # the banner, shown on a terminal only
        system = ("The Beacon Library help desk answers in one short sentence. "
                  + SHARED_SYSTEM.split(". ", 2)[2])
        term.write(b"/system " + system.encode() + b"\n")
        at = term.read_until(re.compile(rb"\(system prompt set\)"), at, 30).end()
        cached = []
        for turn, question in enumerate((b"When are you open on Saturday?",
                                         b"And on Sunday?",
                                         b"How much is a lost card?")):
            at = term.read_until(re.compile(rb"> "), at, 30).end()
            term.write(question + b"\n")
            echo = term.read_until(re.compile(re.escape(question) + rb"\r?\n"), at, 30)
            stats = term.read_until(_STATS, echo.end(), ASK_TIMEOUT_S)
            answer = _ANSI.sub(b"", term.out[echo.end():stats.start()]).strip()
            assert answer, f"turn {turn}: no streamed answer before the stats line"
            # the stats line is faint on a terminal
            line_start = term.out.rfind(b"\n", 0, stats.start()) + 1
            assert term.out[line_start:stats.start()].startswith(b"\x1b[2m"), \
                term.out[line_start:stats.end()]
            served, hops, n_cached, n_prompt, ttft = stats.groups()
            assert served in by_short, served
            assert (int(hops) == 0) == (by_short[served] == entry.peer_b58)
            assert float(ttft) > 0 and 0 <= int(n_cached) <= int(n_prompt)
            cached.append(int(n_cached))
            at = stats.end()
            # as a user's typing time would: let the entry hear where this turn was cached
            wait_until_known(entry, by_short[served], int(n_prompt) // 16 - 1)
        # turns 2 and 3 extend the conversation of turn 1: its prefix is in a cache
        assert cached[1] > 0 and cached[2] > 0, (cached, term.out[-1500:])
        term.write(b"/stats\n")
        term.read_until(re.compile(rb"turns: 3 answered, 0 cancelled, 0 failed"), at, 30)
        term.write(b"/quit\n")
        assert term.close() == 0
    finally:
        if term.proc.poll() is None:
            term.proc.kill()


# --- tenant isolation -----------------------------------------------------------------


# Every rendered prompt starts with the chat template's header (``<|im_start|>system\n``,
# a few tokens), which a namespace's own earlier requests legitimately cache; anything a
# tenant reuses from *another* tenant would be whole 16-token blocks of the long prompt.
HEADER_ONLY = 16


def _memo(topic: str) -> tuple[str, str]:
    """A long system prompt that starts with ``topic`` (unique per test), and a question."""
    return (f"{topic} is an internal project. " + SHARED_SYSTEM.replace("Lighthouse", topic),
            f"Summarise what {topic} is about in one sentence.")


def test_tenants_do_not_share_cached_prefixes(swarm, client_configs):
    a, b, c = swarm
    system, question = _memo("Heron")
    first = ask_json(a.addr, question, system=system, config=client_configs["t1"])["stats"]
    assert first["cached_tokens"] < HEADER_ONLY, first
    assert first["served_by"] in (a.peer_b58, b.peer_b58)  # only A and B hold t1's secret
    blocks = first["prompt_tokens"] // 16 - 1
    wait_until_known(a, first["served_by"], blocks)
    again = ask_json(a.addr, question, system=system, config=client_configs["t1"])["stats"]
    assert again["cached_tokens"] >= 16 * blocks, again  # t1 reuses its own cache
    # the same prompt as t2, through the node that served t1: nothing from t1's cache
    other = ask_json(a.addr, question, system=system, config=client_configs["t2"])["stats"]
    assert other["served_by"] in (a.peer_b58, c.peer_b58)  # only A and C hold t2's secret
    assert other["cached_tokens"] < HEADER_ONLY, other


def test_t1_digests_mean_nothing_to_a_node_without_the_t1_secret(swarm, client_configs):
    a, b, c = swarm
    system, question = _memo("Osprey")
    before = hashes_seen(c.addr)
    first = ask_json(a.addr, question, system=system, config=client_configs["t1"])["stats"]
    server = first["served_by"]
    blocks = first["prompt_tokens"] // 16 - 1
    # C (no t1 secret) holds the server's t1 digest: its index view counts the new blocks
    poll(lambda: hashes_seen(c.addr).get(server, 0) >= before.get(server, 0) + blocks,
         "C to receive the t1 digest")
    # ... but they match nothing C can compute: the same prompt as t2 through C is cold
    as_t2 = ask_json(c.addr, question, system=system, config=client_configs["t2"])["stats"]
    assert as_t2["cached_tokens"] < HEADER_ONLY, as_t2
    # t1 through C: C cannot serve t1, it relays to a node with the secret, which has it
    relayed = ask_json(c.addr, question, system=system, config=client_configs["t1"])["stats"]
    assert relayed["served_by"] in (a.peer_b58, b.peer_b58), relayed
    assert relayed["entry"] == c.peer_b58
    assert relayed["cached_tokens"] >= 16 * blocks // 2, relayed


def test_a_wrong_tenant_secret_is_refused_with_one_line(swarm, client_configs):
    a = swarm[0]
    proc = cli("ask", "--peer", a.addr, "--config", str(client_configs["t1-wrong"]),
               "--max-tokens", MAX_TOKENS, "Summarise the memo about Project Heron.")
    assert proc.returncode == 1, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("prefixmesh ask: ") and "namespace" in lines[0], lines


def _request_with(entry: str, credential_of) -> BaseException | None:
    """Send one t1 request whose credential comes from
    ``credential_of(tenant, id, dl, content_digest)``."""
    from prefixmesh.node.client import Client
    from prefixmesh.node.tenants import Tenant, TenantSpec

    class Tampered(Tenant):
        def credential(self, request_id: bytes, deadline: float, content: bytes) -> bytes:
            return credential_of(self, request_id, deadline, content)

    async def main() -> BaseException | None:
        async with Client.connect(entry) as client:
            real = Tenant.derive(
                TenantSpec(name="t1", secret=T1_SECRET.encode(), visibility="private"),
                await client.model_fingerprint())
            tampered = Tampered(spec=real.spec, namespace_key=real.namespace_key,
                                ns_id=real.ns_id)
            try:
                await client.ask([("user", "hello")], tenant=tampered, max_tokens=4)
            except Exception as exc:  # noqa: BLE001 - returned for the test to inspect
                return exc
            return None

    return trio.run(main)


def test_forged_and_missing_credentials_are_refused(swarm):
    from prefixmesh.node.client import Client, RequestFailed
    from prefixmesh.node.tenants import make_credential

    a = swarm[0]
    forged = _request_with(a.addr, lambda t, rid, dl, c: bytes(32))
    assert isinstance(forged, RequestFailed) and forged.code == "unauthorized", forged
    assert "credential" in forged.message.lower(), forged.message
    assert "unauthorized" in Client.describe_error(forged)
    missing = _request_with(a.addr, lambda t, rid, dl, c: b"")
    assert isinstance(missing, RequestFailed) and missing.code == "unauthorized", missing
    assert "credential" in missing.message.lower(), missing.message
    # control: the real credential of the same tenant is accepted
    ok = _request_with(a.addr, lambda t, rid, dl, c: make_credential(t.namespace_key, rid, dl, c))
    assert ok is None, ok


# --- bad configuration at start -------------------------------------------------------


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


BAD_CONFIGS = {
    # name: (the [node] lines that break it, text the error must contain)
    "unknown key": ('colour = "blue"', "[node].colour: unknown key"),
    "wrong type": ("mdns = 1", "[node].mdns"),
    "key file is a directory": ('key_file = "keys-dir"', "keys-dir"),
    "key file under a regular file": ('key_file = "plain-file/node.key"', "plain-file"),
    "key file readable by others": ('key_file = "open.key"', "open.key"),
    "bad multiaddr": ('bootstrap = ["/ip4/127.0.0.1/tcp/notaport/p2p/x"]', "[node].bootstrap"),
    "budget in parsecs": ('ram_budget = "12 parsecs"', '"12 parsecs" is not a size'),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_a_bad_config_stops_the_node_at_once_with_one_line(case, tmp_path):
    (tmp_path / "keys-dir").mkdir()
    (tmp_path / "plain-file").write_text("not a folder\n")
    from prefixmesh.overlay.core.identity import Identity
    from prefixmesh.overlay.keyfile import save_identity

    save_identity(Identity.generate(), tmp_path / "open.key")
    (tmp_path / "open.key").chmod(0o644)  # a stat check: refused even for root
    lines, needle = BAD_CONFIGS[case]
    port = free_port()
    listen = f'listen = "/ip4/127.0.0.1/tcp/{port}"'
    cfg = tmp_path / "bad.toml"
    defaults = {"listen": listen, "mdns": "mdns = false", "cache_dir": 'cache_dir = "kv"',
                "key_file": 'key_file = "node.key"'}
    key = lines.split("=", 1)[0].strip()
    body = [v for k, v in defaults.items() if k != key] + [lines]
    cfg.write_text("[node]\n" + "\n".join(body) + "\n[model]\n"
                   f"path = {json.dumps(str(default_model_path()))}\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    try:  # forked from the fork server where it can be: the same main, no imports
        proc = _forkserver.run([*CLI, "node", "--config", str(cfg)], timeout=30,
                               stdin_devnull=True)
    except subprocess.TimeoutExpired as exc:  # killed
        pytest.fail(f"{case}: the node started instead of refusing the config: "
                    f"{exc.stdout}{exc.stderr}")
    out, err = proc.stdout, proc.stderr
    assert proc.returncode != 0, (case, out, err)
    err_lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(err_lines) == 1, (case, err)
    assert needle in err_lines[0], (case, err_lines[0])
    print(f"{case}: {err_lines[0]}")
    assert "ready" not in out and "/p2p/" not in out, (case, out)
    # nothing half-started: the port is free again and no file appeared next to the config
    assert _port_is_free(port), case
    assert sorted(p.name for p in tmp_path.iterdir()) == before, case
    assert not (tmp_path / "kv").exists()
