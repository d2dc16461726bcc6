"""KV cache element types: bytes per token and agreement of greedy outputs with f16.

``python -m prefixmesh.inference.bench_kvtype --prompts 50`` runs the same chat prompts
(cold, greedy, ``--max-tokens`` each) through one engine per configuration and compares every
output token-for-token with the f16 reference (flash attention off, the engine's default):

- ``state_bytes_per_token``: size of the saved per-sequence state / tokens it holds;
- ``identical``: prompts whose whole output equals the reference;
- ``mean_common_prefix``: mean fraction of the output that matches before the first
  difference; ``first_token_agree``: prompts whose first token matches;
- ``prefill_tps``/``decode_tps``: medians (the machine may be shared: see docs).

A quantized V cache needs flash attention in llama.cpp, so ``f16+fa`` is listed too: it
separates what flash attention changes from what quantization changes.
"""

from __future__ import annotations

import argparse
import json
import statistics

__all__ = ["CONFIGS", "bench_kvtype", "chat_prompts", "main"]

CONFIGS = {
    "f16": dict(type_k="f16", type_v="f16", flash_attn=False),
    "q8_0-k": dict(type_k="q8_0", type_v="f16", flash_attn=False),
    "f16+fa": dict(type_k="f16", type_v="f16", flash_attn=True),
    "q8_0+fa": dict(type_k="q8_0", type_v="q8_0", flash_attn=True),
    "q4_0+fa": dict(type_k="q4_0", type_v="q4_0", flash_attn=True),
}

_TOPICS = (
    "the moon", "photosynthesis", "the French revolution", "prime numbers", "volcanoes",
    "the internet", "honey bees", "black holes", "the Roman empire", "rainbows",
    "electricity", "the ocean tides", "democracy", "vaccines", "glaciers",
    "the printing press", "DNA", "earthquakes", "jazz music", "the stock market",
    "coffee", "the Great Wall of China", "gravity", "penguins", "solar panels",
)
_ASKS = ("Explain {} in two sentences.", "Give me three facts about {}.")


def chat_prompts(n: int) -> list[list[dict]]:
    out = []
    for i in range(n):
        topic = _TOPICS[i % len(_TOPICS)]
        ask = _ASKS[(i // len(_TOPICS)) % len(_ASKS)]
        if i >= 2 * len(_TOPICS):
            ask = "In simple words, what is {}?" if i % 2 else "Why does {} matter?"
        out.append([{"role": "system", "content": "You are a helpful, concise assistant."},
                    {"role": "user", "content": ask.format(topic)}])
    return out


def _run(cfg: dict, prompts, max_tokens: int, threads: int, model) -> dict:
    from .engine import Engine, SamplingParams

    eng = Engine(model_path=model, n_ctx=512, n_threads=threads, kv_dir=None,
                 ram_budget_bytes=256 << 20, disk_budget_bytes=0, **cfg)
    params = SamplingParams(max_tokens=max_tokens)
    outs, prefill, decode = [], [], []
    try:
        per_token = None
        for msgs in prompts:
            # a fresh namespace per prompt keeps every run cold (no shared system prompt)
            c = eng.chat(msgs, ns=eng.namespace(f"p{len(outs)}"), params=params)
            assert c.stats.cached_tokens == 0
            outs.append(c.tokens)
            if c.stats.prefill_s > 0:
                prefill.append(c.stats.prefill_tokens / c.stats.prefill_s)
            if c.stats.decode_tps:
                decode.append(c.stats.decode_tps)
            if per_token is None:
                body = len(eng.render_chat(msgs).tokens) - 1
                per_token = (eng.store.stats.ram_bytes - 4 * (body + 1)) / body
    finally:
        eng.close(flush=False)
    return {"outputs": outs, "state_bytes_per_token": round(per_token, 1),
            "prefill_tps": statistics.median(prefill), "decode_tps": statistics.median(decode)}


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def bench_kvtype(n_prompts: int = 50, max_tokens: int = 32, threads: int = 1, model=None,
                 configs=tuple(CONFIGS), log=lambda m: None) -> dict:
    prompts = chat_prompts(n_prompts)
    results = {}
    for name in configs:
        results[name] = _run(CONFIGS[name], prompts, max_tokens, threads, model)
        log(f"{name}: done")
    ref = results["f16"]["outputs"]
    table = {}
    for name, r in results.items():
        outs = r["outputs"]
        table[name] = {
            **{k: v for k, v in r.items() if k != "outputs"},
            "identical": sum(o == f for o, f in zip(outs, ref, strict=True)),
            "first_token_agree": sum(o[:1] == f[:1] for o, f in zip(outs, ref, strict=True)),
            "mean_common_prefix": round(statistics.mean(
                _common(o, f) / max(1, max(len(o), len(f)))
                for o, f in zip(outs, ref, strict=True)), 3),
            "prompts": len(outs),
        }
    return {"max_tokens": max_tokens, "threads": threads, "configs": table}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default=None)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    a = ap.parse_args(argv)
    out = bench_kvtype(a.prompts, a.max_tokens, a.threads, a.model, a.configs.split(","),
                       log=lambda m: print(m, flush=True))
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
