"""Grammar-constrained sampling and logprobs in the engine (the real default model).

Logprobs are checked against an independent llama.cpp context of the same model that
evaluates the same tokens (prompt body in one batch, last prompt token alone, then each
generated token alone, as the engine's batch discipline does)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from _model_fixture import TEST_THREADS, default_model_path

from prefixmesh.inference.engine import Engine, InvalidRequestError, SamplingParams

N_CTX = 512
MESSAGES = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def _engine(**kw) -> Engine:
    return Engine(model_path=default_model_path(), n_ctx=N_CTX, n_threads=TEST_THREADS,
                  kv_dir=None, ram_budget_bytes=64 << 20, disk_budget_bytes=0, fsync=False, **kw)


@pytest.fixture(scope="module")
def eng():
    e = _engine()
    yield e
    e.close(flush=False)


def _gbnf(schema) -> str:
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    return json_schema_to_gbnf(json.dumps(schema))


def test_a_grammar_constrains_the_output(eng):
    c = eng.chat(MESSAGES, params=SamplingParams(max_tokens=8, grammar='root ::= "Yes." | "No."'),
                 timeout=60)
    assert c.text in ("Yes.", "No.")
    assert c.finish_reason == "stop"  # EOG as soon as the grammar is complete


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_json_schema_grammar_gives_valid_json(eng, temperature):
    msgs = [{"role": "user", "content": "Describe a person as JSON."}]
    for seed in range(3):
        c = eng.chat(msgs, params=SamplingParams(max_tokens=40, temperature=temperature,
                                                 seed=seed, grammar=_gbnf(PERSON)), timeout=60)
        obj = json.loads(c.text)
        assert set(obj) == {"name", "age"} and isinstance(obj["age"], int), c.text
        assert len(obj["name"]) <= 12
        if temperature == 0.0:
            break


def test_a_bad_grammar_is_refused_at_submission(eng):
    for bad in ("root ::= undefined-rule", 'start ::= "a"', "root ::= root \"a\""):
        with pytest.raises(InvalidRequestError, match="cannot parse the grammar"):
            eng.check_grammar(bad)
        with pytest.raises(InvalidRequestError):
            eng.submit_chat(MESSAGES, params=SamplingParams(max_tokens=4, grammar=bad))
    with pytest.raises(InvalidRequestError, match="logprobs"):
        eng.submit_chat(MESSAGES, params=SamplingParams(max_tokens=4, logprobs=21))
    eng.check_grammar('root ::= "ok"')


def _reference_logits(prompt: list[int], generated: list[int]) -> list[np.ndarray]:
    """Logits before each generated token, from a separate llama.cpp context."""
    import llama_cpp
    from llama_cpp import llama_cpp as lib

    original = lib.llama_model_default_params

    def no_repack():
        p = original()
        p.use_extra_bufts = False  # as the engine loads the model
        return p

    lib.llama_model_default_params = no_repack
    try:
        llm = llama_cpp.Llama(model_path=str(default_model_path()), n_ctx=N_CTX,
                              n_threads=TEST_THREADS, n_threads_batch=TEST_THREADS,
                              logits_all=False, verbose=False)
    finally:
        lib.llama_model_default_params = original
    try:
        n = llm.n_vocab()

        def last() -> np.ndarray:
            ptr = lib.llama_get_logits_ith(llm._ctx.ctx, -1)
            return np.ctypeslib.as_array(ptr, shape=(n,)).copy()

        llm.eval(prompt[:-1])
        llm.eval(prompt[-1:])
        out = [last()]
        for tok in generated[:-1]:
            llm.eval([tok])
            out.append(last())
        return out
    finally:
        llm.close()


def test_logprobs_equal_an_independent_computation(eng):
    pieces = []
    h = eng.submit_chat(MESSAGES, params=SamplingParams(max_tokens=6, logprobs=5),
                        on_token=pieces.append)
    c = h.result(60)
    prompt = list(eng.render_chat(MESSAGES).tokens)
    ref = _reference_logits(prompt, c.tokens)
    worst = 0.0
    for piece, logits in zip(pieces, ref, strict=True):
        x = logits.astype(np.float64)
        lse = float(np.log(np.exp(x - x.max()).sum()) + x.max())
        want = float(x[piece.token] - lse)
        assert math.isfinite(piece.logprob) and piece.logprob <= 0.0
        worst = max(worst, abs(piece.logprob - want))
        assert piece.data == eng._llama.detokenize([piece.token])
        lps = [lp for _, lp in piece.top]
        assert len(lps) == 5 and lps == sorted(lps, reverse=True)
        assert piece.top[0][1] == pytest.approx(piece.logprob)  # greedy: the best token
        assert int(np.argmax(x)) == piece.token
    assert worst < 1e-4, worst


def test_throughput_mode_applies_grammars_and_logprobs():
    e = _engine(batch_mode="throughput", max_batch=2)
    try:
        hs = [e.submit_chat([{"role": "user", "content": f"Person number {i} as JSON."}],
                            params=SamplingParams(max_tokens=40, grammar=_gbnf(PERSON),
                                                  logprobs=2 if i else None))
              for i in range(2)]
        for h in hs:
            obj = json.loads(h.result(120).text)
            assert set(obj) == {"name", "age"}
    finally:
        e.close(flush=False)


@pytest.mark.parametrize("mode", ["deterministic", "throughput"])
def test_the_end_of_sequence_token_comes_with_the_completion(mode):
    """A generation the model ended reports the end-of-sequence token it chose (not in
    the text) with its logprob and runner-up when asked: spot checks judge an answer that
    goes on past that point by how clearly the model chose to stop."""
    e = _engine(batch_mode=mode, max_batch=2)
    try:
        ended = e.submit_chat(MESSAGES, params=SamplingParams(max_tokens=64, logprobs=2))
        plain = e.submit_chat(MESSAGES, params=SamplingParams(max_tokens=64))
        cut = e.submit_chat(MESSAGES, params=SamplingParams(max_tokens=2, logprobs=2))
        c, p, short = ended.result(120), plain.result(120), cut.result(120)
        assert c.finish_reason == "stop" and c.end is not None
        assert e._lib.llama_vocab_is_eog(e._vocab, c.end.token) and c.end.text == ""
        assert math.isfinite(c.end.logprob) and c.end.logprob <= 0.0
        assert [lp for _, lp in c.end.top] == sorted((lp for _, lp in c.end.top), reverse=True)
        assert len(c.end.top) == 2 and c.end.top[0][1] == pytest.approx(c.end.logprob)
        # without logprobs, the token alone (rows of one batch may differ: issue 17)
        assert p.finish_reason != "stop" or (p.end.text == "" and p.end.logprob is None)
        assert short.finish_reason == "length" and short.end is None
    finally:
        e.close(flush=False)
