"""node/chat_cli.py: the chat UI loop against a scripted terminal and a fake send()."""

from __future__ import annotations

import io
import math

import trio
import trio.testing

from prefixmesh.node.chat_cli import (
    FAINT,
    PROMPT,
    Eof,
    Interrupt,
    Line,
    StdinTerminal,
    TurnStats,
    chat_loop,
    format_peers,
    format_stats,
)

INTERRUPT = object()


class ScriptedTerminal:
    """Answers each line request with the next scripted item; interrupts can be injected."""

    def __init__(self, script):
        self.script = list(script)
        self.prompts: list[str] = []
        self.send, self.recv = trio.open_memory_channel(100)

    def request_line(self, prompt):
        self.prompts.append(prompt)
        while self.script and self.script[0] is INTERRUPT:
            self.script.pop(0)
            self.send.send_nowait(Interrupt())
        item = self.script.pop(0) if self.script else None
        self.send.send_nowait(Eof() if item is None else Line(item))

    def interrupt(self):
        self.send.send_nowait(Interrupt())

    async def next_event(self):
        return await self.recv.receive()


def stats_for(n_messages: int) -> TurnStats:
    return TurnStats(served_by="12D3KooWServerPeerIdXYZ123456", hops=1, prompt_tokens=10 * n_messages,
                     cached_tokens=8 * n_messages, completion_tokens=2, ttft_s=0.25, total_s=0.5)


class FakeModel:
    """send(): echoes the last user message word by word, then the stats."""

    def __init__(self):
        self.calls: list[list[dict]] = []

    async def send(self, messages):
        self.calls.append(messages)
        for word in ("echo:", *messages[-1]["content"].split()):
            await trio.sleep(0)
            yield word + " "
        yield stats_for(len(messages))


def run(script, send=None, **kwargs):
    model = FakeModel()
    term = ScriptedTerminal(script)
    out = io.StringIO()

    async def main():
        return await chat_loop(send or model.send, term, out, **kwargs)

    session = trio.run(main)
    return session, out.getvalue(), model, term


def test_multi_turn_history_and_stats_line():
    session, out, model, term = run(["hello there", "again"])
    assert "echo: hello there" in out and "echo: again" in out
    assert [m["role"] for m in model.calls[1]] == ["user", "assistant", "user"]
    assert model.calls[1][1]["content"] == "echo: hello there "
    assert "served by 12D3KooW…123456 · 1 hop · cached 8/10 prompt tokens · TTFT 0.25 s" in out
    assert FAINT not in out  # not a tty: no ANSI codes
    assert session.turns == 2 and session.prompt_tokens == 40 and session.cached_tokens == 32
    assert term.prompts == [PROMPT] * 3  # two lines, then EOF


def test_stats_line_is_faint_on_a_tty():
    _, out, _, _ = run(["hi"], color=True)
    assert f"{FAINT}served by" in out


def test_slash_commands():
    session, out, model, _ = run(["/system be brief", "q1", "/stats", "/reset", "q2",
                                  "/system", "/nope", "/help", "/quit", "never read"])
    assert model.calls[0][0] == {"role": "system", "content": "be brief"}
    assert [m["role"] for m in model.calls[1]] == ["system", "user"]  # reset kept the system
    assert "turns: 1 answered" in out and "from cache: 16 (80%)" in out
    assert "(system prompt: 'be brief')" in out
    assert "unknown command /nope" in out and "/reset" in out
    assert session.turns == 2


def test_eof_exits_and_blank_lines_are_ignored():
    session, _, model, _ = run(["", "   ", None])
    assert session.turns == 0 and model.calls == []


def test_ctrl_c_twice_at_prompt_exits_once_continues():
    session, out, model, _ = run([INTERRUPT, "hi", INTERRUPT, INTERRUPT])
    assert "Ctrl-C again" in out
    assert session.turns == 1 and len(model.calls) == 1


def test_ctrl_c_cancels_answer_not_chat():
    term_box = {}
    calls = []

    async def slow_send(messages):
        calls.append(messages)
        if len(calls) == 1:
            yield "partial "
            term_box["term"].interrupt()
            await trio.sleep_forever()  # a stuck peer: only cancellation ends it
        yield "complete"
        yield stats_for(len(messages))

    model = FakeModel()
    term = ScriptedTerminal(["first", "second"])
    term_box["term"] = term
    out = io.StringIO()

    async def main():
        return await chat_loop(slow_send, term, out)

    session = trio.run(main)
    assert "partial \n(cancelled)" in out.getvalue()
    assert "complete" in out.getvalue()
    assert session.cancelled == 1 and session.turns == 1
    # the cancelled turn is not in the history
    assert [m["content"] for m in calls[1]] == ["second"]
    assert model.calls == []


def test_send_error_is_one_line_and_chat_goes_on():
    async def failing(messages):
        if messages[-1]["content"] == "boom":
            raise ConnectionError("peer unreachable")
        yield "ok"
        yield stats_for(1)

    session, out, _, _ = run(["boom", "fine"], send=failing,
                             on_error=lambda e: f"{type(e).__name__}: {e}")
    assert "error: ConnectionError: peer unreachable" in out
    assert session.errors == 1 and session.turns == 1


def test_format_stats_edge_cases():
    s = TurnStats(served_by="abc", hops=0, prompt_tokens=5, cached_tokens=0)
    assert format_stats(s) == "served by abc · 0 hops · cached 0/5 prompt tokens"
    assert math.isnan(s.ttft_s) and s.to_json()["ttft_s"] is None
    # an answer decoded in a shared batch says so (it may differ from a deterministic run)
    assert format_stats(TurnStats(served_by="abc", batched=True)).endswith(" · batched")


def test_format_peers():
    text = format_peers({"self": "me", "addrs": ["/ip4/127.0.0.1/tcp/1"], "peers": [
        {"peer": "12D3KooWAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", "connected": True, "up": True,
         "rtt_ms": 1.25, "queue_depth": 2, "active": 1, "n_hashes": 40, "digest_age_s": 0.5}]})
    assert "node me" in text and "1.2" in text and "0.5 s" in text
    assert "no peers" in format_peers({"self": "me", "peers": []})


def test_stdin_terminal_reads_through_its_thread():
    lines = iter(["one", "two"])

    def fake_input(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    async def main():
        term = StdinTerminal(fake_input)
        async with term.open():
            got = []
            for _ in range(3):
                term.request_line("> ")
                with trio.fail_after(5):
                    got.append(await term.next_event())
            return got

    assert trio.run(main) == [Line("one"), Line("two"), Eof()]
