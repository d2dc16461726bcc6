#!/usr/bin/env bash
# A three-node prefixmesh swarm on this machine (127.0.0.1), driven through the public CLI.
#
#   examples/three_node_swarm.sh            # start, ask three questions, stop
#   examples/three_node_swarm.sh --chat     # ... then chat through node 2 (needs a terminal)
#   examples/three_node_swarm.sh --fast     # short answers (what the test suite runs)
#   examples/three_node_swarm.sh --keep     # keep the temporary folder (keys, logs, caches)
#
# What it shows: three nodes with their own keys and KV cache folders under one temporary
# folder; nodes 2 and 3 know only node 1 (bootstrap) and find each other through it. Three
# questions share one long system prompt and enter the swarm through a *different* node
# each time. The first is prefilled cold; the later ones are routed to a node that already
# holds the system prompt's KV cache ("cached" > 0) instead of prefilling it again.
#
# Before each question the script waits until the next entry node has heard, through the
# digest gossip, that some peer caches blocks (it polls `prefixmesh peers --json`), so the
# run does not depend on fixed sleeps.
#
# Environment: PREFIXMESH (the CLI to run; default: `prefixmesh` on PATH, else this
# checkout's .venv/bin/prefixmesh), PYTHON (for JSON parsing; default python3),
# PREFIXMESH_FAST=1 (same as --fast), READY_TIMEOUT (seconds, default 120).
# Needs the default model: `prefixmesh model fetch` (once).
#
# Every node is stopped when the script exits, however it exits (trap on EXIT, INT, TERM):
# SIGTERM first (the node finishes cleanly and flushes its KV index), SIGKILL after 10 s.

set -euo pipefail
{ # the whole script is one block: bash parses it before running, so editing this file
  # while a swarm runs cannot change what the running script does next

usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; }

FAST=${PREFIXMESH_FAST:-0}
CHAT=0
KEEP=0
for arg in "$@"; do
  case "$arg" in
    --fast) FAST=1 ;;
    --chat) CHAT=1 ;;
    --keep) KEEP=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "three_node_swarm.sh: unknown argument $arg (see --help)" >&2; exit 2 ;;
  esac
done

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [[ -z "${PREFIXMESH:-}" ]]; then
  if command -v prefixmesh >/dev/null 2>&1; then
    PREFIXMESH=prefixmesh
  elif [[ -x "$HERE/../.venv/bin/prefixmesh" ]]; then
    PREFIXMESH="$HERE/../.venv/bin/prefixmesh"
  else
    echo "three_node_swarm.sh: prefixmesh not found (pip install it, or set PREFIXMESH)" >&2
    exit 1
  fi
fi
PYTHON=${PYTHON:-python3}
READY_TIMEOUT=${READY_TIMEOUT:-120}
if [[ "$FAST" == 1 ]]; then MAX_TOKENS=8 CHAT_MAX_TOKENS=16; else MAX_TOKENS=64 CHAT_MAX_TOKENS=256; fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/prefixmesh-swarm.XXXXXX")
PIDS=()
OK=0

cleanup() {
  local status=$?
  trap - EXIT INT TERM
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  if [[ "$OK" == 1 && "$KEEP" == 0 ]]; then
    rm -rf "$WORK"
  else
    echo "(keys, logs and caches kept in $WORK)" >&2
  fi
  echo "swarm stopped"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Settings shared by the three nodes; per-node paths and addresses are flags below.
cat >"$WORK/swarm.toml" <<'EOF'
[node]
mdns = false              # the nodes find each other through node 1 (bootstrap)
ram_budget = "256MiB"
disk_budget = "256MiB"
log_level = "warning"

[model]
n_ctx = 2048
n_threads = 1             # three nodes share this machine's cores

[digest]
interval_s = 0.5          # gossip cache digests often, so the demo converges quickly
EOF

# run NODE_NUMBER [--bootstrap ADDR]: start one node in the background (its own session,
# so a Ctrl-C in `chat` does not reach it); prints go to node$N/stdout.log
start_node() {
  local n=$1; shift
  local dir="$WORK/node$n"
  mkdir -p "$dir"
  "$PREFIXMESH" keygen --out "$dir/node.key" >"$dir/peer_id"
  local launcher=()
  if command -v setsid >/dev/null 2>&1; then launcher=(setsid); fi
  PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 "${launcher[@]}" "$PREFIXMESH" node \
    --config "$WORK/swarm.toml" --listen /ip4/127.0.0.1/tcp/0 \
    --key-file "$dir/node.key" --cache-dir "$dir/kv" "$@" \
    >"$dir/stdout.log" 2>"$dir/stderr.log" </dev/null &
  PIDS+=($!)
  echo "node$n pid $! peer $(cat "$dir/peer_id")"
}

# wait_ready N PID: the node prints its multiaddrs, then "ready"; sets ADDR to the first
wait_ready() {
  local n=$1 pid=$2 dir="$WORK/node$1" waited=0
  until grep -qx ready "$dir/stdout.log" 2>/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "node$n exited during start-up:" >&2; tail -n 5 "$dir/stderr.log" >&2; exit 1
    fi
    if (( waited >= READY_TIMEOUT * 10 )); then
      echo "node$n not ready after ${READY_TIMEOUT} s:" >&2; tail -n 5 "$dir/stderr.log" >&2
      exit 1
    fi
    sleep 0.1; waited=$((waited + 1))
  done
  ADDR=$(grep -m1 '^/ip4/' "$dir/stdout.log")
}

# peers_count ADDR: "UP CACHING": peers the node sees up, and peers it knows cache blocks
peers_count() {
  "$PREFIXMESH" peers --json --peer "$1" 2>/dev/null | "$PYTHON" -c '
import json, sys
peers = json.load(sys.stdin)["peers"]
print(sum(1 for p in peers if p["up"]), sum(1 for p in peers if p["n_hashes"] > 0))
' 2>/dev/null || echo "0 0"
}

# wait_for ADDR WHAT MIN_UP MIN_CACHING: poll the node's peer view (no fixed sleeps)
wait_for() {
  local addr=$1 what=$2 min_up=$3 min_caching=$4 up caching
  for _ in $(seq 120); do
    read -r up caching < <(peers_count "$addr")
    if (( up >= min_up && caching >= min_caching )); then return 0; fi
    sleep 0.5
  done
  echo "timed out waiting for $what" >&2
  exit 1
}

echo "starting three nodes on 127.0.0.1 (work folder $WORK)"
start_node 1
wait_ready 1 "${PIDS[0]}"; ADDR1=$ADDR
start_node 2 --bootstrap "$ADDR1"
start_node 3 --bootstrap "$ADDR1"
wait_ready 2 "${PIDS[1]}"; ADDR2=$ADDR
wait_ready 3 "${PIDS[2]}"; ADDR3=$ADDR
ENTRIES=("$ADDR1" "$ADDR2" "$ADDR3")
for i in 0 1 2; do echo "  node$((i + 1)) ${ENTRIES[$i]}"; done
for i in 0 1 2; do wait_for "${ENTRIES[$i]}" "node$((i + 1)) to see both other nodes" 2 0; done
echo "all three nodes see each other"

SYSTEM="You are the help desk assistant of the Lighthouse Public Library. Answer in one or \
two short sentences. Opening hours: Monday to Friday 9:00-20:00, Saturday 10:00-16:00, closed \
on Sundays and public holidays. Members may borrow up to 12 items for three weeks and renew \
them twice online unless someone reserved them. Late returns cost 20 cents per item per day, \
capped at 5 euros. Membership is free for residents; visitors pay 15 euros a year. The \
reading room on the second floor is silent; group study rooms on the first floor can be \
booked for two hours a day. Printing costs 10 cents a page in black and white and 40 cents in \
colour. Wi-Fi is free: network Lighthouse-Guest, no password. Lost cards are replaced for 2 \
euros at the front desk. The children's corner has picture books, comics and board games, \
and a story hour every Wednesday at 16:00. The library café on the ground floor serves \
coffee, tea and sandwiches from 10:00 to 18:00. Lockers near the entrance take a 1 euro \
coin that you get back. Parking is free for one hour in the yard behind the building."
QUESTIONS=(
  "When are you open on Saturday?"
  "How much does it cost if I return a book four days late?"
  "Can I book a study room for the whole afternoon?"
)

echo
echo "three questions sharing a ${#SYSTEM}-character system prompt, each through another node"
printf '%-6s %-9s %4s %14s %8s  %s\n' entry "served by" hops cached/prompt TTFT answer
for i in 0 1 2; do
  entry=${ENTRIES[$i]}
  if (( i > 0 )); then
    # the earlier answer left the system prompt's blocks in some node's cache; wait until
    # this entry node has that node's digest, so routing can use it
    wait_for "$entry" "node$((i + 1)) to learn who caches the system prompt" 2 1
  fi
  "$PREFIXMESH" ask --json --peer "$entry" --max-tokens "$MAX_TOKENS" --system "$SYSTEM" \
    "${QUESTIONS[$i]}" >"$WORK/answer$i.json"
  "$PYTHON" - "$WORK/answer$i.json" "node$((i + 1))" "$ADDR1" "$ADDR2" "$ADDR3" <<'EOF'
import json, sys
path, entry, *addrs = sys.argv[1:]
names = {a.rsplit("/", 1)[1]: f"node{i + 1}" for i, a in enumerate(addrs)}
result = json.load(open(path))
st = result["stats"]
answer = " ".join(result["answer"].split())
ttft = f"{st['ttft_s']:.2f} s" if st["ttft_s"] is not None else "-"
print(f"{entry:<6} {names.get(st['served_by'], '?'):<9} {st['hops']:>4} "
      f"{str(st['cached_tokens']) + '/' + str(st['prompt_tokens']):>14} {ttft:>8}  "
      f"{answer[:50]}{'…' if len(answer) > 50 else ''}")
for hop in st["route"]:
    print(f"{'':<6} route: {hop}")
EOF
done
echo
echo "Later questions reuse the system prompt's KV cache (cached > 0) wherever they enter."

OK=1

if [[ "$CHAT" == 1 ]]; then
  if [[ -t 0 && -t 1 ]]; then
    echo
    echo "chatting through node2; /system TEXT sets a system prompt, /stats, /quit (or Ctrl-D)"
    # a client config: which node to talk to, and how long answers may be
    printf '[client]\npeer = "%s"\nmax_tokens = %d\n' "$ADDR2" "$CHAT_MAX_TOKENS" \
      >"$WORK/client.toml"
    # Ctrl-C belongs to the chat (it cancels an answer) while it runs, not to this script
    trap : INT
    "$PREFIXMESH" chat --config "$WORK/client.toml" || true
    trap 'exit 130' INT
  else
    echo "(--chat needs a terminal; skipped)" >&2
  fi
fi
exit 0
}
