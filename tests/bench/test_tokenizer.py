"""bench/tokenizer.py: the simulator's proxy tokenizer keeps shared text prefixes as shared
token prefixes (property-based), breaks after a newline, and ChatML rounds are text
prefixes of each other. Workload loaders: tests/bench/test_workloads.py."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.bench.tokenizer import ProxyTokenizer, render_chatml


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200), st.text(max_size=200), st.text(max_size=200))
def test_proxy_tokenizer_keeps_shared_prefixes(prefix, a, b):
    tok = ProxyTokenizer()
    ta, tb, tp = tok.encode(prefix + a), tok.encode(prefix + b), tok.encode(prefix)
    shared = 0
    while shared < min(len(ta), len(tb)) and ta[shared] == tb[shared]:
        shared += 1
    # Only the last piece of the common prefix may differ (it can merge with what follows),
    # and one piece yields at most ceil(len / MAX_WORD_PIECE) + 1 ids.
    assert shared >= len(tp) - (len(prefix) // 6 + 2)
    assert tok.encode(prefix + a) == ta  # deterministic


def test_proxy_tokenizer_boundaries_after_newline():
    tok = ProxyTokenizer()
    head = "The following are questions.\n\n"
    assert tok.encode(head + "What is 2+2?")[: len(tok.encode(head))] == tok.encode(head)


def test_chatml_rounds_are_text_prefixes():
    r1 = [{"role": "user", "content": "hi"}]
    r2 = r1 + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    assert render_chatml(r2).startswith(render_chatml(r1))
