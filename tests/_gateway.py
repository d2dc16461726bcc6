"""Test helper: the HTTP gateway on loopback against a scripted fake backend
(``FakeBackend``), and a real node process with its gateway (``HttpNode``).

Not a test module; shared by the gateway, dashboard and Ollama API tests.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import httpx
import trio
from _swarm import NodeProc, Swarm, free_port
from openai import OpenAI

from prefixmesh.node.http_gateway import (
    Finished,
    GatewaySettings,
    GenerationJob,
    PromptCounted,
    Started,
    TextDelta,
    serve_http,
)
from prefixmesh.node.openai_schema import ApiError, Usage

MODEL = "fake-model"
ROUTE = {"entry": "12D3KooWentry", "serving": "12D3KooWserve", "ttft_ms": 1.0,
         "total_ms": 2.0, "hops": [
             {"peer": "12D3KooWentry", "action": "forward", "next": "12D3KooWserve",
              "matched": 0, "reason": "peer holds 48 tokens", "ttft_ms": 1.5},
             {"peer": "12D3KooWserve", "action": "serve", "matched": 48,
              "reason": "serve", "ttft_ms": 1.0}]}


class FakeBackend:
    """Scripted generations. ``cached_tokens`` of a request = the longest common prefix
    (in characters) of its prompt with an earlier prompt of the same tenant, like a
    prefix cache would report."""

    def __init__(self, words=("Hello", " world", ".", " Bye", " now")):
        self.words = list(words)
        self.delay_s = 0.0
        self.forever = False  # generate until cancelled
        self.fail: ApiError | None = None  # raised before the first token
        self.fail_after_tokens: ApiError | None = None
        # the serving node's counts before the first text (the mesh's first TOKENS frame);
        # (False: the entry knows the prompt count itself and the cached count stays unsaid)
        self.counts_first: bool = False
        self.jobs: list[GenerationJob] = []
        self.active = 0
        self.cancelled = 0
        self.finished = 0
        self.tokens_generated = 0
        self._seen: dict[str, list[str]] = {}

    def model_ids(self):
        return [MODEL, "prefixmesh"]

    def tenant_names(self):
        return ["public", "team"]

    def status(self):
        return {"inflight": self.active}

    def _prompt(self, job: GenerationJob) -> str:
        if job.prompt is not None:
            return job.prompt
        return "".join(f"<{r}>{c}" for r, c in job.messages)

    @contextlib.asynccontextmanager
    async def generation(self, job: GenerationJob):
        self.jobs.append(job)
        if self.fail is not None:
            raise self.fail
        prompt = self._prompt(job)
        earlier = self._seen.setdefault(job.tenant, [])
        cached = max((_common_prefix(prompt, p) for p in earlier), default=0)
        earlier.append(prompt)
        self.active += 1
        done = {"ok": False}

        async def events():
            yield Started(0 if self.counts_first else len(prompt))
            if self.counts_first:
                yield PromptCounted(len(prompt), cached)
            n = 0
            while True:
                for w in self.words:
                    if n >= job.sampling.max_tokens:
                        break
                    if self.fail_after_tokens is not None and n == 2:
                        raise self.fail_after_tokens
                    await trio.sleep(self.delay_s)
                    n += 1
                    self.tokens_generated += 1
                    yield TextDelta(w, 1)
                if not self.forever or n >= job.sampling.max_tokens:
                    break
            done["ok"] = True
            reason = "length" if n >= job.sampling.max_tokens else "stop"
            yield Finished(reason, Usage(len(prompt), n, cached), ROUTE)

        try:
            async with contextlib.aclosing(events()) as ev:
                yield ev
        finally:
            self.active -= 1
            if done["ok"]:
                self.finished += 1
            else:
                self.cancelled += 1


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Gateway:
    """serve_http in a thread; ``url`` is ``http://127.0.0.1:PORT``."""

    def __init__(self, backend, settings: GatewaySettings):
        self.backend = backend
        self.settings = settings
        self.url = ""
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        async def run():
            with trio.CancelScope() as cs:
                self._cancel = cs
                self._token = trio.lowlevel.current_trio_token()
                async with trio.open_nursery() as nursery:
                    self.url = await nursery.start(serve_http, self.backend, self.settings)
                    self._ready.set()

        try:
            trio.run(run)
        except BaseException as exc:  # surfaced by start()
            self._error = exc
            self._ready.set()

    def start(self) -> Gateway:
        self._thread.start()
        assert self._ready.wait(10), "gateway did not start"
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        with contextlib.suppress(trio.RunFinishedError):
            trio.from_thread.run_sync(self._cancel.cancel, trio_token=self._token)
        self._thread.join(10)


@contextlib.contextmanager
def running(backend=None, **settings) -> Iterator[tuple[Gateway, FakeBackend]]:
    backend = backend or FakeBackend()
    settings.setdefault("listen", "127.0.0.1:0")
    gw = Gateway(backend, GatewaySettings(**settings)).start()
    try:
        yield gw, backend
    finally:
        gw.stop()


def client(gw: Gateway, key: str = "unused", **kw) -> OpenAI:
    return OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=20, **kw)


def wait_until(pred, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


TEAM_SECRET = "team-secret-for-the-gateway-test"


class HttpNode:
    """A node process with its HTTP gateway on a free loopback port."""

    def __init__(self, swarm: Swarm, name: str, *, api_key: str | None = None, **kwargs):
        """``api_key``: the gateway-wide key (then every request sends it, ``headers``);
        without one the gateway serves only the public tenant over HTTP."""
        self.proc: NodeProc = swarm.add(name, **self._prepare(swarm, name, api_key, kwargs))

    def _prepare(self, swarm: Swarm, name: str, api_key: str | None, kwargs: dict) -> dict:
        """Write the node's gateway config; returns the ``Swarm.add`` keyword arguments."""
        self.port = free_port()
        self.api_key = api_key
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        cfg = swarm.root / f"{name}.toml"
        key_line = f'api_key = "{api_key}"\n' if api_key else ""
        cfg.write_text(f'[http]\nlisten = "127.0.0.1:{self.port}"\n{key_line}'
                       '[tenants.public]\nvisibility = "public"\n'
                       f'[tenants.team]\nsecret = "{TEAM_SECRET}"\n')
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = name
        return {"extra": ["--config", str(cfg)], "n_ctx": 4096, **kwargs}

    @classmethod
    def add_many(cls, swarm: Swarm, names, *, api_key: str | None = None,
                 **kwargs) -> list[HttpNode]:
        """Several gateway nodes started together (``Swarm.add_many``), same settings."""
        nodes = [cls.__new__(cls) for _ in names]
        specs = [(name, node._prepare(swarm, name, api_key, dict(kwargs)))
                 for node, name in zip(nodes, names, strict=True)]
        for node, proc in zip(nodes, swarm.add_many(specs), strict=True):
            node.proc = proc
        return nodes

    def client(self) -> OpenAI:
        return OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0,
                      timeout=120)

    def status(self) -> dict:
        return httpx.get(self.url + "/prefixmesh/status", headers=self.headers,
                         timeout=10).json()
