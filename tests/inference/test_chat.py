"""Chat rendering: validation, template rendering, and verified message boundaries."""

from __future__ import annotations

import pytest
from _model_fixture import default_model_path
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.inference.chat import (
    ChatRenderer,
    EmptyPromptError,
    MalformedMessagesError,
    TemplateError,
    UnknownRoleError,
)
from prefixmesh.inference.model import read_gguf_info

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def char_tokenizer(text: str) -> list[int]:
    """One token per character: tokens(a + b) == tokens(a) + tokens(b) always."""
    return [ord(c) for c in text]


def merging_tokenizer(text: str) -> list[int]:
    """Merges '\\n<' into one token: splits at such a seam are NOT consistent."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("\n<", i):
            out.append(100_000)
            i += 2
        else:
            out.append(ord(text[i]))
            i += 1
    return out


def test_render_and_boundaries_with_consistent_tokenizer():
    r = ChatRenderer(CHATML, char_tokenizer)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    out = r.render(msgs)
    assert out.text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n" \
        "<|im_start|>assistant\n"
    assert list(out.tokens) == char_tokenizer(out.text)
    first = len("<|im_start|>system\nS<|im_end|>\n")
    second = first + len("<|im_start|>user\nhi<|im_end|>\n")
    assert out.boundaries == (first, second)


def test_boundaries_where_tokenization_is_inconsistent_are_dropped():
    r = ChatRenderer(CHATML, merging_tokenizer)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    out = r.render(msgs)
    # Each rendered prefix ends in '\n' and the rest begins with '<': the full prompt merges
    # them, so no boundary is consistent and none is kept.
    assert out.boundaries == ()


@pytest.mark.parametrize(
    "messages, error",
    [
        ([], EmptyPromptError),
        ("hello", MalformedMessagesError),
        ([{"role": "robot", "content": "x"}], UnknownRoleError),
        ([{"role": "tool", "content": "x"}], UnknownRoleError),
        ([{"content": "x"}], UnknownRoleError),
        ([{"role": "user", "content": None}], MalformedMessagesError),
        ([{"role": "user", "content": ["a"]}], MalformedMessagesError),
        (["user: hi"], MalformedMessagesError),
    ],
)
def test_bad_messages(messages, error):
    r = ChatRenderer(CHATML, char_tokenizer)
    with pytest.raises(error):
        r.render(messages)


def test_template_errors_are_typed():
    r = ChatRenderer("{{ raise_exception('no system role') }}", char_tokenizer)
    with pytest.raises(TemplateError, match="no system role"):
        r.render([{"role": "user", "content": "x"}])
    with pytest.raises(TemplateError, match="does not compile"):
        ChatRenderer("{% for %}", char_tokenizer)
    r = ChatRenderer("{{ messages[5]['content'] }}", char_tokenizer)
    with pytest.raises(TemplateError):
        r.render([{"role": "user", "content": "x"}])


def test_empty_render_is_refused():
    r = ChatRenderer("{% if false %}x{% endif %}", char_tokenizer)
    with pytest.raises(EmptyPromptError):
        r.render([{"role": "user", "content": "x"}])


def test_bos_added_only_when_the_model_wants_it():
    r = ChatRenderer(CHATML, char_tokenizer, bos_token_id=1, add_bos=True)
    out = r.render([{"role": "user", "content": "x"}])
    assert out.tokens[0] == 1 and out.tokens[1:] == tuple(char_tokenizer(out.text))
    assert all(b > 1 for b in out.boundaries)
    r = ChatRenderer("<s>" + CHATML, lambda t: [1] + char_tokenizer(t[3:]) if t.startswith("<s>")
                     else char_tokenizer(t), bos_token_id=1, add_bos=True)
    out = r.render([{"role": "user", "content": "x"}])
    assert out.tokens.count(1) == 1  # template's own BOS, not doubled


def test_long_conversation_verifies_a_bounded_number_of_boundaries():
    calls = []

    def counting(text):
        calls.append(text)
        return char_tokenizer(text)

    r = ChatRenderer(CHATML, counting)
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": str(i)} for i in range(100)]
    out = r.render(msgs)
    assert len(calls) <= 1 + 16
    assert len(out.boundaries) == 16


# ---------------------------------------------------------------- with the real tokenizer


@pytest.fixture(scope="module")
def real_renderer():
    import llama_cpp

    path = default_model_path()
    info = read_gguf_info(path)
    vocab = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    yield ChatRenderer(
        info.chat_template,
        lambda t: vocab.tokenize(t.encode("utf-8"), add_bos=False, special=True),
        bos_token_id=info.metadata["tokenizer.ggml.bos_token_id"],
        add_bos=bool(info.metadata.get("tokenizer.ggml.add_bos_token")),
    ), vocab
    vocab.close()


def test_real_template_special_tokens_and_default_system(real_renderer):
    r, vocab = real_renderer
    out = r.render([{"role": "user", "content": "Hello"}])
    # SmolLM2's template inserts its default system prompt when none is given
    assert out.text.startswith("<|im_start|>system\nYou are a helpful AI assistant")
    im_start = vocab.tokenize(b"<|im_start|>", add_bos=False, special=True)
    assert len(im_start) == 1 and out.tokens[0] == im_start[0]  # parsed as ONE special token
    assert out.tokens.count(im_start[0]) == 3
    assert len(out.boundaries) == 1


@settings(max_examples=60, deadline=None)
@given(
    contents=st.lists(
        st.text(alphabet=st.sampled_from(list("ab \n.,!?é😀<|>")), max_size=12),
        min_size=1,
        max_size=5,
    )
)
def test_real_boundaries_are_consistent(real_renderer, contents):
    r, _ = real_renderer
    roles = ["system"] + ["user", "assistant"] * 3
    msgs = [{"role": roles[i], "content": c} for i, c in enumerate(contents)]
    out = r.render(msgs)
    for b in out.boundaries:
        # the defining property: the prompt's tokens start with the prefix's tokens
        prefix_text = None
        for i in range(1, len(msgs) + 1):
            t = r.render_text(msgs[:i], add_generation_prompt=False)
            if len(r.tokenize_text(t)) == b:
                prefix_text = t
        assert prefix_text is not None
        assert out.tokens[:b] == tuple(r.tokenize_text(prefix_text))
