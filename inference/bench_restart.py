"""Ready-after-restart and stop time of an engine with a big disk cache.

``python -m prefixmesh.inference.bench_restart --cache-gb 1.5`` builds a disk cache of
synthetic-but-valid state files (the engine's own fingerprint, namespace and file format;
random payloads of real state sizes: 300-1,500 tokens x the model's bytes per token) plus
one real state of a 1,024-token prefix, then, ``--runs`` times: drops the files from the OS
page cache (``posix_fadvise(DONTNEED)``), starts an engine on the folder and times

- ready: ``Engine(...)`` returns (model load + disk index from the file headers);
- index: the ``KVStore`` start-up alone (the part that grows with the cache);
- first hit: TTFT of the real prefix + 16 tokens, restored from disk (checksum included);
- stop: ``close()`` right after that request (its state is written by then or dropped).

Medians are printed as JSON. Not part of CI (it writes ``--cache-gb`` to disk).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

__all__ = ["bench_restart", "main"]


def drop_page_cache(root: Path) -> None:
    """Evict the cache files under ``root`` from the page cache (a restart that reads disk)."""
    if not hasattr(os, "posix_fadvise"):
        return
    for path in root.rglob("*.kv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# the cache is filled with states of 300-1,500 tokens (7-35 MB each at 23 KB/token): a
# smaller cache would hold none of them and the fill would never reach its target
MIN_CACHE_GB = 0.1


def bench_restart(cache_gb: float = 1.5, runs: int = 3, threads: int = 1,
                  model: str | None = None, kv_dir: str | None = None,
                  log=lambda msg: None) -> dict:
    if not cache_gb >= MIN_CACHE_GB:
        raise ValueError(f"cache_gb must be at least {MIN_CACHE_GB} (got {cache_gb})")
    from .engine import Engine, SamplingParams
    from .kvstore import KVStore

    tmp = None
    if kv_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="pm-restart-")
        kv_dir = tmp.name
    root = Path(kv_dir)
    n_ctx = 1100
    kw = dict(model_path=model, n_ctx=n_ctx, n_threads=threads, kv_dir=root,
              ram_budget_bytes=256 << 20, disk_budget_bytes=int(cache_gb * 2 * (1 << 30)))
    one = SamplingParams(max_tokens=1)
    rng = random.Random(0)
    try:
        eng = Engine(**kw)
        ns = eng.default_namespace
        real = [rng.randrange(100, 40000) for _ in range(1024 + 16)]
        eng.complete_tokens(real, params=one)  # one real state (1,023 tokens)
        per_token = eng.store.stats.ram_bytes // 1023
        fp = eng.state_fingerprint
        eng.store.wait_written()  # write-behind: the real state is on disk before the count
        eng.close()
        # synthetic states: valid files of real sizes, written by the store itself
        store = KVStore(fingerprint=fp, ram_budget_bytes=0, disk_budget_bytes=kw[
            "disk_budget_bytes"], disk_dir=root, fsync=False)
        target = int(cache_gb * (1 << 30))
        nprng = np.random.default_rng(1)
        n_files = 1
        max_puts = 4 * target // (300 * per_token) + 16  # room for refusals, never forever
        while store.disk_used_bytes < target:
            if n_files > max_puts:
                raise RuntimeError(f"the store took {store.disk_used_bytes} of {target} bytes "
                                   f"after {n_files - 1} states: it refuses them")
            n_tok = rng.randrange(300, 1500)
            toks = [rng.randrange(100, 40000) for _ in range(n_tok)]
            store.put(ns.id, toks, nprng.bytes(n_tok * per_token))
            n_files += 1
        store.wait_written()  # close() waits 10 s at most: every file on disk, then count
        store.close()
        cache_bytes = sum(p.stat().st_size for p in root.rglob("*.kv"))
        log(f"cache: {n_files} files, {cache_bytes / 1e9:.2f} GB")
        ready, index, hit, stop = [], [], [], []
        for r in range(runs):
            drop_page_cache(root)
            t0 = time.perf_counter()
            eng = Engine(**kw)
            ready.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            KVStore(fingerprint=fp, ram_budget_bytes=0, disk_budget_bytes=kw[
                "disk_budget_bytes"], disk_dir=root).close()
            index.append(time.perf_counter() - t0)
            c = eng.complete_tokens(real, params=one)
            assert c.stats.hit_tier == "disk", c.stats
            hit.append(c.stats.ttft_s)
            t0 = time.perf_counter()
            eng.close()
            stop.append(time.perf_counter() - t0)
            log(f"run {r}: ready {ready[-1]:.3f} s, index {index[-1]:.3f} s, "
                f"first hit {hit[-1]:.3f} s, stop {stop[-1]:.3f} s")
        med = statistics.median
        return {"cache_bytes": cache_bytes, "files": n_files, "bytes_per_token": per_token,
                "runs": runs, "threads": threads, "ready_s": med(ready),
                "index_s": med(index), "first_disk_hit_ttft_s": med(hit), "stop_s": med(stop),
                "ready_all": ready, "stop_all": stop}
    finally:
        if tmp is not None:
            tmp.cleanup()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-gb", type=float, default=1.5)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default=None)
    ap.add_argument("--kv-dir", default=None, help="folder for the cache (default: a temp dir)")
    a = ap.parse_args(argv)
    if not a.cache_gb >= MIN_CACHE_GB:
        ap.error(f"--cache-gb must be at least {MIN_CACHE_GB} (got {a.cache_gb})")
    out = bench_restart(a.cache_gb, a.runs, a.threads, a.model, a.kv_dir,
                        log=lambda m: print(m, flush=True))
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
