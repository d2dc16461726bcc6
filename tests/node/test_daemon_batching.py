"""A node whose engine batches (``[model] batch_mode = "throughput"``), as a real process
with the real default model: concurrent requests share ``llama_decode`` calls, every
answer says it was batched (the FINAL frame, ``prefixmesh ask --json``), and the operator
sees the batching in the overview and in ``/metrics``."""

from __future__ import annotations

import contextlib
import json
import sys

import _forkserver
import httpx
import pytest
import trio
from _swarm import Swarm, free_port

from prefixmesh.node.client import Client

pytestmark = pytest.mark.slow

QUESTIONS = ("Why is the sea salty?", "What is a comet made of?", "How do bees make honey?",
             "Why do leaves change colour?")


def test_a_throughput_node_batches_concurrent_requests_and_says_so(tmp_path):
    port = free_port()
    cfg = tmp_path / "batching.toml"
    cfg.write_text(f'[model]\nbatch_mode = "throughput"\n[metrics]\nlisten = "127.0.0.1:{port}"\n')
    with Swarm(tmp_path) as s:
        a = s.add("A", extra=["--config", str(cfg)])
        answers = trio.run(_ask_at_once, a.addr)
        assert len(answers) == len(QUESTIONS), s.logs()
        assert all(ans.final.batched and ans.text for ans in answers)

        ov = httpx.get(f"http://127.0.0.1:{port}/prefixmesh/overview", timeout=30).json()
        engine = ov["node"]["engine"]
        assert engine["batch_mode"] == "throughput" and engine["batch_steps"] > 0
        # four requests at once shared decode calls
        assert engine["sequences_per_step"] > 1.0, engine
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        samples = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                   if line.startswith("prefixmesh:engine_batch_")}
        steps = samples["prefixmesh:engine_batch_steps_total"]
        assert steps == engine["batch_steps"]
        assert samples["prefixmesh:engine_batch_sequences_total"] > steps

        # the CLI's JSON says so too (a deterministic node's says false: test_cli_e2e)
        out = _forkserver.run([sys.executable, "-m", "prefixmesh", "ask", "--peer", a.addr,
                               "--json", "--max-tokens", "4", "Hello?"], timeout=60)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["stats"]["batched"] is True


async def _ask_at_once(addr: str) -> list:
    """Every question on its own connection, all connected first and then sent together
    (so that they overlap in the engine whatever the connection set-up costs)."""
    answers: list = []
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(Client.connect(addr)) for _ in QUESTIONS]

        async def one(client, question: str) -> None:
            answers.append(await client.ask([("user", question)], max_tokens=16))

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for client, question in zip(clients, QUESTIONS, strict=True):
                    nursery.start_soon(one, client, question)
    return answers
