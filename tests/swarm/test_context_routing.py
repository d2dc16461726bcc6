"""Context lengths across the mesh, real nodes and the real model: nodes say their context
length in their PONGs; an entry node whose own context is too small for a prompt forwards
it to a peer it fits, and refuses with ``context_length_exceeded`` (not a retryable
``no_route``) a prompt that fits no node."""

from __future__ import annotations

import time

import pytest
from _swarm import Swarm, ask, peers, wait_until

from prefixmesh.node.client import RequestFailed

pytestmark = pytest.mark.slow

# ~33 tokens per repetition with SmolLM2's tokenizer
PARAGRAPH = ("The archive keeps letters, maps and ledgers from the harbour town, sorted by "
             "decade and by the family that wrote them, with an index card for each. ")


def _prompt(repeats: int):
    return [("system", "Answer in one short sentence."),
            ("user", PARAGRAPH * repeats + "What does the archive keep?")]


def test_an_entry_node_forwards_a_prompt_too_long_for_it_and_refuses_one_too_long_for_all(
        tmp_path):
    with Swarm(tmp_path) as s:
        small = s.add("small", n_ctx=256)
        big = s.add("big", n_ctx=1024, bootstrap=[small.addr])

        wait_until(lambda: any(p.up for p in peers(small.addr).peers), timeout_s=30,
                   what="the small node to see the big one up")
        time.sleep(2.0)  # a few more PONGs (each carries the context length)
        answer = ask(small.addr, _prompt(10), max_tokens=2)  # ~340 tokens
        assert answer.final.prompt_tokens > 256
        assert answer.final.serving == big.peer_id
        with pytest.raises(RequestFailed) as exc:
            ask(small.addr, _prompt(40), max_tokens=2)  # ~1,330 tokens: fits no node
        assert exc.value.code == "context_length_exceeded"
