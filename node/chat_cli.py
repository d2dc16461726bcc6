"""The terminal front end of the light client: ``prefixmesh chat``, ``ask`` and ``peers``.

``chat`` is an interactive multi-turn chat. Tokens are written as they arrive; after each
answer one dim line (ANSI faint, only when stdout is a terminal) says who served it, over
how many forwarding hops, how many prompt tokens came from a KV cache, and the TTFT.
Slash commands: ``/reset`` (forget the conversation), ``/stats`` (session totals),
``/system TEXT`` (set the system prompt; ``/system`` shows it), ``/help``, ``/quit``.

Ctrl-C while an answer streams cancels that answer (it is not added to the history);
Ctrl-C at the prompt asks for confirmation, a second one (or Ctrl-D / EOF) exits.

Design: :func:`chat_loop` is independent of the network and of the real terminal. It
talks to a :class:`Terminal` (line requests and an event stream of lines, EOF and
interrupts) and to an injected ``send(messages)`` returning an async iterator of text
pieces that ends with one :class:`TurnStats`. :class:`StdinTerminal` is the real terminal:
one daemon thread owns ``input()`` (so a cancelled read never loses a typed line: there is
never more than one read outstanding) and SIGINT arrives through
``trio.open_signal_receiver`` instead of as KeyboardInterrupt.
"""

from __future__ import annotations

import contextlib
import json
import math
import queue
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO

import trio

from .turnstats import TurnStats

__all__ = [
    "TurnStats",
    "Line",
    "Eof",
    "Interrupt",
    "Terminal",
    "StdinTerminal",
    "ChatSession",
    "Send",
    "chat_loop",
    "format_stats",
    "run_chat",
    "run_ask",
    "run_peers",
]

PROMPT = "> "
FAINT = "\x1b[2m"
RESET = "\x1b[0m"
HELP = (
    "/reset         forget the conversation (keeps the system prompt)\n"
    "/stats         totals of this session\n"
    "/system TEXT   set the system prompt (/system alone shows it)\n"
    "/quit          leave (also Ctrl-D, or Ctrl-C twice)\n"
    "Ctrl-C while an answer streams cancels that answer."
)


Send = Callable[[list[dict[str, str]]], AsyncIterator["str | TurnStats"]]


def short_peer(peer: str) -> str:
    return peer if len(peer) <= 16 else f"{peer[:8]}…{peer[-6:]}"


def format_stats(stats: TurnStats) -> str:
    hops = "1 hop" if stats.hops == 1 else f"{stats.hops} hops"
    parts = [f"served by {short_peer(stats.served_by)}", hops,
             f"cached {stats.cached_tokens}/{stats.prompt_tokens} prompt tokens"]
    if math.isfinite(stats.ttft_s):
        parts.append(f"TTFT {stats.ttft_s:.2f} s")
    if stats.completion_tokens and math.isfinite(stats.total_s):
        parts.append(f"{stats.completion_tokens} tokens in {stats.total_s:.2f} s")
    if stats.batched:
        parts.append("batched")
    return " · ".join(parts)


# --- terminal -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Line:
    text: str


@dataclass(frozen=True)
class Eof:
    pass


@dataclass(frozen=True)
class Interrupt:
    pass


TermEvent = Line | Eof | Interrupt


class Terminal(Protocol):
    def request_line(self, prompt: str) -> None:
        """Ask for one line; it arrives later as a Line (or Eof) event."""

    async def next_event(self) -> TermEvent:
        """The next line, EOF or interrupt."""


class StdinTerminal:
    """The process's terminal: a reader thread for lines, SIGINT as Interrupt events.

    Use inside ``trio.run``: ``async with StdinTerminal().open() as term: ...``.
    """

    def __init__(self, input_fn: Callable[[str], str] = input):
        self._input = input_fn
        self._requests: queue.Queue[str | None] = queue.Queue()
        self._send, self._recv = trio.open_memory_channel[TermEvent](64)
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None

    def request_line(self, prompt: str) -> None:
        if self._thread is None:
            self._token = trio.lowlevel.current_trio_token()
            self._thread = threading.Thread(target=self._reader, name="chat-stdin", daemon=True)
            self._thread.start()
        self._requests.put(prompt)

    async def next_event(self) -> TermEvent:
        return await self._recv.receive()

    def _reader(self) -> None:
        while True:
            prompt = self._requests.get()
            if prompt is None:
                return
            try:
                event: TermEvent = Line(self._input(prompt))
            except EOFError:
                event = Eof()
            except Exception:  # noqa: BLE001 - a closed stdin reads as the end
                event = Eof()
            try:
                trio.from_thread.run_sync(self._send.send_nowait, event, trio_token=self._token)
            except (trio.RunFinishedError, trio.WouldBlock, trio.ClosedResourceError):
                return

    @contextlib.asynccontextmanager
    async def open(self) -> AsyncIterator[StdinTerminal]:
        """Route SIGINT to Interrupt events while the context is open."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self._forward_signals)
            try:
                yield self
            finally:
                nursery.cancel_scope.cancel()
                self._requests.put(None)  # lets the reader thread end after its read

    async def _forward_signals(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        with trio.open_signal_receiver(signal.SIGINT) as signals:
            task_status.started()
            async for _ in signals:
                try:
                    self._send.send_nowait(Interrupt())
                except trio.WouldBlock:  # 64 unread interrupts: more say nothing new
                    pass


# --- the chat loop ------------------------------------------------------------------------


@dataclass
class ChatSession:
    """Conversation state and session totals."""

    system: str | None = None
    history: list[dict[str, str]] = field(default_factory=list)
    turns: int = 0
    cancelled: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    served_by: dict[str, int] = field(default_factory=dict)

    def messages_with(self, user_text: str) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, *self.history, {"role": "user", "content": user_text}]

    def record(self, user_text: str, answer: str, stats: TurnStats | None) -> None:
        self.history += [{"role": "user", "content": user_text},
                         {"role": "assistant", "content": answer}]
        self.turns += 1
        if stats is not None:
            self.prompt_tokens += stats.prompt_tokens
            self.cached_tokens += stats.cached_tokens
            self.completion_tokens += stats.completion_tokens
            if math.isfinite(stats.ttft_s):
                self.ttfts.append(stats.ttft_s)
            self.served_by[stats.served_by] = self.served_by.get(stats.served_by, 0) + 1

    def summary(self) -> str:
        ratio = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        lines = [
            f"turns: {self.turns} answered, {self.cancelled} cancelled, {self.errors} failed; "
            f"history: {len(self.history)} messages",
            f"prompt tokens: {self.prompt_tokens}, from cache: {self.cached_tokens} "
            f"({ratio:.0%}); answer tokens: {self.completion_tokens}",
        ]
        if self.ttfts:
            mean = sum(self.ttfts) / len(self.ttfts)
            lines.append(f"TTFT mean {mean:.2f} s, min {min(self.ttfts):.2f} s, "
                         f"max {max(self.ttfts):.2f} s")
        if self.served_by:
            lines.append("served by: " + ", ".join(
                f"{short_peer(p)} ×{n}" for p, n in sorted(self.served_by.items(),
                                                           key=lambda kv: -kv[1])))
        return "\n".join(lines)


async def chat_loop(
    send: Send,
    term: Terminal,
    out: TextIO,
    *,
    color: bool = False,
    system: str | None = None,
    on_error: Callable[[BaseException], str] | None = None,
) -> ChatSession:
    """Run the interactive chat until /quit, EOF or a second Ctrl-C at the prompt.

    ``on_error`` turns an exception from ``send`` into the one line shown (default:
    ``str(exc)``); the chat goes on after an error.
    """
    session = ChatSession(system=system)
    reading = False
    interrupted_at_prompt = False

    def say(text: str = "", *, dim: bool = False, end: str = "\n") -> None:
        out.write((f"{FAINT}{text}{RESET}" if dim and color else text) + end)
        out.flush()

    while True:
        if not reading:
            term.request_line(PROMPT)
            reading = True
        event = await term.next_event()
        if isinstance(event, Interrupt):
            if interrupted_at_prompt:
                say()
                return session
            interrupted_at_prompt = True
            say()
            say("(Ctrl-C again or Ctrl-D to quit)", dim=True)
            say(PROMPT, end="")
            continue
        reading = False
        if isinstance(event, Eof):
            say()
            return session
        interrupted_at_prompt = False
        text = event.text.strip()
        if not text:
            continue
        if text.startswith("/"):
            cmd, _, arg = text.partition(" ")
            arg = arg.strip()
            if cmd in ("/quit", "/exit", "/q"):
                return session
            if cmd == "/reset":
                session.history.clear()
                say("(conversation forgotten)", dim=True)
            elif cmd == "/stats":
                say(session.summary(), dim=True)
            elif cmd == "/system":
                if arg:
                    session.system = arg
                    say("(system prompt set)", dim=True)
                else:
                    say(f"(system prompt: {session.system!r})", dim=True)
            elif cmd in ("/help", "/?"):
                say(HELP, dim=True)
            else:
                say(f"unknown command {cmd}; /help lists them", dim=True)
            continue
        await _answer(send, term, session, text, say, on_error)


async def _answer(send: Send, term: Terminal, session: ChatSession, text: str,
                  say: Callable[..., None], on_error: Callable[[BaseException], str] | None
                  ) -> None:
    pieces: list[str] = []
    stats: TurnStats | None = None
    cancelled = False
    failed: BaseException | None = None

    async with trio.open_nursery() as nursery:

        async def watch_interrupts() -> None:
            nonlocal cancelled
            while True:
                event = await term.next_event()
                if isinstance(event, Interrupt):
                    cancelled = True
                    nursery.cancel_scope.cancel()
                    return

        async def stream() -> None:
            nonlocal stats, failed
            try:
                async for item in send(session.messages_with(text)):
                    if isinstance(item, TurnStats):
                        stats = item
                    else:
                        pieces.append(item)
                        say(item, end="")
            except Exception as exc:  # noqa: BLE001 - shown as one line, chat goes on
                failed = exc
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch_interrupts)
        nursery.start_soon(stream)

    if pieces:
        say()
    if cancelled:
        session.cancelled += 1
        say("(cancelled)", dim=True)
        return
    if failed is not None:
        session.errors += 1
        say(f"error: {on_error(failed) if on_error else failed}", dim=False)
        return
    session.record(text, "".join(pieces), stats)
    if stats is not None:
        say(format_stats(stats), dim=True)


# --- commands (wired to node/client.py) ---------------------------------------------------


def _color(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def run_chat(cfg: Any, *, verbose: int = 0, model: str | None = None) -> int:
    """``prefixmesh chat``: the interactive chat against the configured node."""
    from .client import open_client_for_cli  # noqa: PLC0415 - heavy (libp2p)

    async def main() -> None:
        async with open_client_for_cli(cfg) as client:
            out = sys.stdout
            if _color(out):
                out.write(f"{FAINT}connected to {short_peer(client.peer_b58)} "
                          f"(tenant {cfg.client.tenant}); /help for commands{RESET}\n")
            async with StdinTerminal().open() as term:
                await chat_loop(client.chat_send(cfg.client.max_tokens, model=model), term, out,
                                color=_color(out), on_error=client.describe_error)

    trio.run(main)
    return 0


def run_ask(cfg: Any, prompt: str, *, as_json: bool = False, system: str | None = None,
            model: str | None = None) -> int:
    """``prefixmesh ask``: one prompt, answer streamed to stdout (or one JSON object)."""
    from .client import open_client_for_cli  # noqa: PLC0415

    result: dict[str, Any] = {}

    async def main() -> None:
        async with open_client_for_cli(cfg) as client:
            pieces: list[str] = []
            stats: TurnStats | None = None
            send = client.chat_send(cfg.client.max_tokens, model=model)
            messages = [{"role": "system", "content": system}] if system else []
            messages.append({"role": "user", "content": prompt})
            async for item in send(messages):
                if isinstance(item, TurnStats):
                    stats = item
                else:
                    pieces.append(item)
                    if not as_json:
                        sys.stdout.write(item)
                        sys.stdout.flush()
            result["answer"] = "".join(pieces)
            result["stats"] = stats

    trio.run(main)
    stats = result.get("stats")
    if as_json:
        print(json.dumps({"answer": result["answer"],
                          "stats": stats.to_json() if stats else None}, ensure_ascii=False))
    else:
        print()
        if stats is not None and _color(sys.stderr):
            print(f"{FAINT}{format_stats(stats)}{RESET}", file=sys.stderr)
        elif stats is not None:
            print(format_stats(stats), file=sys.stderr)
    return 0


def run_peers(cfg: Any, *, as_json: bool = False) -> int:
    """``prefixmesh peers``: the node's view of its peers."""
    from .client import open_client_for_cli  # noqa: PLC0415

    result: dict[str, Any] = {}

    async def main() -> None:
        async with open_client_for_cli(cfg) as client:
            result["peers"] = await client.peers_report()

    trio.run(main)
    report = result["peers"]
    if as_json:
        print(json.dumps(report, ensure_ascii=False, indent=2))
    else:
        print(format_peers(report))
    return 0


def _model_label(peer: dict[str, Any], models: Sequence[dict[str, Any]]) -> str:
    """A peer's model by name when the catalog lists it, else its fingerprint's start."""
    fp = peer.get("model", "")
    if not fp:
        return "-"
    name = next((m.get("name") for m in models if m.get("fingerprint") == fp), None)
    return name or str(fp)[:16]


def format_peers(report: dict[str, Any]) -> str:
    """A table of a peers report (``{"self": ..., "addrs": [...], "peers": [...]}``)."""
    lines = [f"node {report.get('self', '?')}"]
    for a in report.get("addrs", []):
        lines.append(f"  {a}")
    models = report.get("models", [])
    if models:
        lines.append("models (nodes serving each now):")
        for m in models:
            lines.append(f"  {m.get('name', '?'):<40} {str(m.get('fingerprint', ''))[:16]} "
                         f"{m.get('nodes', 0):>3} node(s){'  (this node)' if m.get('local') else ''}")
    peers: Sequence[dict[str, Any]] = report.get("peers", [])
    if not peers:
        lines.append("no peers")
        return "\n".join(lines)
    lines.append(f"{'peer':<18} {'conn':<4} {'up':<3} {'rtt ms':>7} {'queue':>5} "
                 f"{'active':>6} {'blocks':>7} {'digest age':>10} {'model':<16}")
    for p in peers:
        rtt = p.get("rtt_ms", -1)
        age = p.get("digest_age_s", -1)
        lines.append(
            f"{short_peer(p.get('peer', '?')):<18} {'yes' if p.get('connected') else 'no':<4} "
            f"{'up' if p.get('up') else 'no':<3} {(f'{rtt:.1f}' if rtt >= 0 else '-'):>7} "
            f"{p.get('queue_depth', 0):>5} {p.get('active', 0):>6} {p.get('n_hashes', 0):>7} "
            f"{(f'{age:.1f} s' if age >= 0 else '-'):>10} {_model_label(p, models):<16}"
        )
    return "\n".join(lines)
