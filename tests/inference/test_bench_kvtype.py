"""inference/bench_kvtype.py: its prompts (pure), the agreement arithmetic, and a run through
its entry point at the smallest size (the real default model, two prompts, three tokens,
f16 against a q8_0 K cache, ~2 s)."""

from __future__ import annotations

import json

from _model_fixture import TEST_THREADS, default_model_path

from prefixmesh.inference import bench_kvtype


def test_chat_prompts_are_distinct_deterministic_user_turns():
    prompts = bench_kvtype.chat_prompts(60)
    assert len(prompts) == 60 and prompts == bench_kvtype.chat_prompts(60)
    texts = [p[-1]["content"] for p in prompts]
    assert all(p[-1]["role"] == "user" for p in prompts)
    assert len(set(texts)) == len(texts)
    assert bench_kvtype.chat_prompts(3) == prompts[:3]


def test_common_prefix_length():
    assert bench_kvtype._common([1, 2, 3], [1, 2, 4]) == 2
    assert bench_kvtype._common([1, 2], [1, 2, 3]) == 2
    assert bench_kvtype._common([], [1]) == 0


def test_tiny_run_compares_with_the_f16_reference(capsys):
    argv = ["--prompts", "2", "--max-tokens", "3", "--configs", "f16,q8_0-k",
            "--threads", str(TEST_THREADS), "--model", str(default_model_path())]
    assert bench_kvtype.main(argv) == 0
    out = capsys.readouterr().out
    report = json.loads(out[out.index("{"):])
    f16, q8 = report["configs"]["f16"], report["configs"]["q8_0-k"]
    # the reference agrees with itself entirely
    assert (f16["identical"], f16["first_token_agree"], f16["mean_common_prefix"]) == (2, 2, 1.0)
    assert f16["prompts"] == q8["prompts"] == 2
    assert 0 <= q8["identical"] <= q8["first_token_agree"] <= 2
    # a q8_0 K cache is smaller per token than f16
    assert q8["state_bytes_per_token"] < f16["state_bytes_per_token"]
