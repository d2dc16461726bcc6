"""``prefixmesh demo``: a small swarm on 127.0.0.1 that shows prefix-cache routing.

Steps: make sure the default model is there (``model fetch``), create N node identities
and configs in a temporary folder (listen on free loopback ports, every node bootstraps
from the others, mDNS off, small cache budgets), start N ``prefixmesh node`` processes,
wait until each prints ``ready``, then ask questions that share one long system
prompt through *different* entry nodes with ``prefixmesh ask --json`` and print, per
question, which node served it, the hops, and how many prompt tokens came from a cache.
The first question is served cold; later ones should be routed to the node that holds
the shared prefix. All processes are stopped (SIGINT, then SIGKILL after 10 s) at the end;
their logs are kept in the temporary folder when something fails.

It drives the nodes only through the public CLI, so it doubles as an end-to-end check.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["run_demo", "SYSTEM_PROMPT", "QUESTIONS"]

SYSTEM_PROMPT = (
    "You are the help desk assistant of the Lighthouse Public Library. Answer in one or two "
    "short sentences. Opening hours: Monday to Friday 9:00-20:00, Saturday 10:00-16:00, "
    "closed on Sundays and public holidays. Members may borrow up to 12 items for three "
    "weeks and renew them twice online unless someone reserved them. Late returns cost "
    "20 cents per item per day, capped at 5 euros. Membership is free for residents; "
    "visitors pay 15 euros a year. The reading room on the second floor is silent; group "
    "study rooms on the first floor can be booked for two hours a day. Printing costs 10 "
    "cents a page in black and white and 40 cents in colour. Wi-Fi is free: network "
    "Lighthouse-Guest, no password. Lost cards are replaced for 2 euros at the front desk."
)
QUESTIONS = (
    "When are you open on Saturday?",
    "How much does it cost if I return a book four days late?",
    "Can I book a study room for the whole afternoon?",
    "How much do 25 colour pages cost?",
)
READY_TIMEOUT_S = 120.0
ASK_TIMEOUT_S = 180.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(log: Path) -> bool:
    """The daemon prints its addresses and then a line ``ready`` on stdout."""
    try:
        return "ready" in log.read_text(errors="replace").splitlines()
    except OSError:
        return False


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=3, metavar="N", help="nodes to start (2-8)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (logs)")


def run_demo(args: argparse.Namespace) -> int:
    from prefixmesh.inference.model import ModelFetchError, resolve_model
    from prefixmesh.overlay.core.identity import Identity
    from prefixmesh.overlay.keyfile import save_identity

    n_nodes = int(getattr(args, "nodes", 3))
    if not 2 <= n_nodes <= 8:
        print("prefixmesh demo: --nodes must be between 2 and 8", file=sys.stderr)
        return 2
    try:
        model = resolve_model(None)
    except ModelFetchError as exc:
        print(f"prefixmesh demo: cannot get the default model: {exc}", file=sys.stderr)
        return 1

    work = Path(tempfile.mkdtemp(prefix="prefixmesh-demo-"))
    nodes = []
    for i in range(n_nodes):
        ident = Identity.generate()
        key = work / f"node{i}.key"
        save_identity(ident, key)
        port = _free_port()
        nodes.append({"i": i, "id": ident.peer_id_b58, "key": key, "port": port,
                      "addr": f"/ip4/127.0.0.1/tcp/{port}/p2p/{ident.peer_id_b58}",
                      "log": work / f"node{i}.log", "cfg": work / f"node{i}.toml"})
    # one machine runs every node: share its cores instead of oversubscribing them
    threads = max(1, (os.cpu_count() or 1) // n_nodes)
    for n in nodes:
        boot = [m["addr"] for m in nodes if m is not n]
        n["cfg"].write_text(
            "[node]\n"
            f'listen = "/ip4/127.0.0.1/tcp/{n["port"]}"\n'
            f"bootstrap = {json.dumps(boot)}\n"
            "mdns = false\n"
            f'key_file = "{n["key"]}"\n'
            f'cache_dir = "{work / ("kv" + str(n["i"]))}"\n'
            'ram_budget = "256MiB"\ndisk_budget = "512MiB"\n'
            "[model]\n"
            f"path = {json.dumps(str(model))}\n"
            "n_ctx = 2048\n"
            f"n_threads = {threads}\n"
            "[digest]\ninterval_s = 0.5\n"
        )

    procs: list[subprocess.Popen[bytes]] = []
    ok = False
    try:
        print(f"starting {n_nodes} nodes on 127.0.0.1 (logs in {work})")
        for n in nodes:
            with open(n["log"], "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "prefixmesh", "node", "--config", str(n["cfg"])],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                ))
        deadline = time.monotonic() + READY_TIMEOUT_S
        for n, proc in zip(nodes, procs, strict=True):
            while not _ready(n["log"]):
                if proc.poll() is not None:
                    print(f"node{n['i']} exited with status {proc.returncode}:\n"
                          f"{_tail(n['log'])}", file=sys.stderr)
                    return 1
                if time.monotonic() > deadline:
                    print(f"node{n['i']} was not ready within "
                          f"{READY_TIMEOUT_S:.0f} s:\n{_tail(n['log'])}", file=sys.stderr)
                    return 1
                time.sleep(0.2)
            print(f"  node{n['i']} {n['id']} on port {n['port']}")
        time.sleep(2.0)  # let the nodes connect and exchange their first digests

        names = {n["id"]: f"node{n['i']}" for n in nodes}
        print(f"\n{len(QUESTIONS)} questions sharing a {len(SYSTEM_PROMPT)}-character "
              "system prompt, each through a different entry node:\n")
        print(f"{'entry':<6} {'served by':<9} {'hops':>4} {'cached/prompt':>14} "
              f"{'TTFT':>7}  answer")
        for q_i, question in enumerate(QUESTIONS):
            entry = nodes[q_i % n_nodes]
            cmd = [sys.executable, "-m", "prefixmesh", "ask", "--json", "--peer", entry["addr"],
                   "--system", SYSTEM_PROMPT, "--max-tokens", "48", question]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True,
                                      timeout=ASK_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                print(f"ask through node{entry['i']} timed out", file=sys.stderr)
                return 1
            if proc.returncode != 0:
                print(f"ask through node{entry['i']} failed: {proc.stderr.strip()}",
                      file=sys.stderr)
                return 1
            result = json.loads(proc.stdout)
            st = result.get("stats") or {}
            ttft = st.get("ttft_s")
            answer = " ".join(result.get("answer", "").split())
            print(f"node{entry['i']:<2} {names.get(st.get('served_by', ''), '?'):<9} "
                  f"{st.get('hops', 0):>4} "
                  f"{str(st.get('cached_tokens', 0)) + '/' + str(st.get('prompt_tokens', 0)):>14} "
                  f"{(f'{ttft:.2f} s' if ttft is not None else '-'):>7}  "
                  f"{answer[:60]}{'…' if len(answer) > 60 else ''}")
            time.sleep(1.5)  # a digest round, so the others learn who cached the prefix
        ok = True
        print("\nLater questions reuse the shared system prompt's KV cache: they are routed "
              "to a node that holds it (cached > 0) instead of prefilling it again.")
        return 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if ok and not getattr(args, "keep", False):
            shutil.rmtree(work, ignore_errors=True)
        elif not ok:
            print(f"(logs kept in {work})", file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser(prog="python -m prefixmesh.node.demo")
    add_demo_arguments(parser)
    raise SystemExit(run_demo(parser.parse_args()))

