"""Starting a node process: :func:`run_node` (``prefixmesh node``, and the benchmark and
test entry points ``bench/node_entry.py``, ``tests/_fault_node.py``).

Why apart from ``node/daemon.py``: what fails fast should fail before anything slow, and
the engine's load (the model, a 1.6 GB KV cache's index) should begin before the rest of
the node is imported (0.2 s), so the two overlap. This module takes the locks, checks the
listen port and reads the key file, starts the engine's load in a thread, and only then
imports the daemon. py-libp2p (0.5 s more) is imported later still, once the node answers
HTTP (``node/daemon.py``, "Start-up"; docs/bench/engine.md, "ready after restart").

From the start of the load to the moment the daemon installs its own handlers, a
SIGINT/SIGTERM exits at once with status 130, as it does during the rest of start-up
(nothing needs a graceful stop yet).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading

import trio

from prefixmesh.inference.backend import Backend, BackendError
from prefixmesh.overlay.core.identity import IdentityError
from prefixmesh.overlay.ports import HostError, check_listen_addrs_free

from . import process
from .locks import LockError, lock_cache_dir, lock_key_file
from .logsetup import configure_logging
from .process import NodeOptions, exit_now

__all__ = ["run_node"]

log = logging.getLogger("prefixmesh.node")


def _exit_on_signals_during_start_up() -> dict:
    """SIGINT/SIGTERM exit at once until the daemon installs its handlers (module
    docstring); returns the handlers they replace."""
    if threading.current_thread() is not threading.main_thread():
        return {}  # signals reach the main thread only (a node run in a test's thread)

    def on_signal(signum: int, _frame) -> None:
        exit_now(130, f"signal {signum} during start-up: exiting now")

    return {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}


def run_node(config, options: NodeOptions | None = None) -> int:
    """Run a node until SIGINT/SIGTERM (the CLI's ``prefixmesh node``)."""
    options = options or NodeOptions()
    # one line per record; py-libp2p's routine peer failures at DEBUG (node/logsetup.py)
    configure_logging(config.node.log_level, getattr(config.node, "log_format", "text"))
    from prefixmesh.inference.model import ModelFetchError

    locks = []
    failed = True
    node = None
    backend: Backend | None = None
    old_handlers: dict = {}
    try:
        # before the key is read or created: two nodes started at once cannot both
        # create (or both use) one identity; the cache dir lock also names a cache dir
        # that is a file. Held until the process exits (the kernel drops flocks).
        locks.append(lock_key_file(config.node.key_file))
        locks.append(lock_cache_dir(config.node.cache_dir))
        check_listen_addrs_free([config.node.listen])
        identity = process.load_or_create_identity(config.node.key_file)
        backend = process.make_backend(config, options)  # tests/_fault_node.py wraps it
        old_handlers = _exit_on_signals_during_start_up()
        backend.begin_load()
        from . import daemon  # the node's own imports, while the engine loads

        node = daemon.Node(config, options, identity=identity, backend=backend)
        trio.run(node.run)
        failed = False
    except (IdentityError, ModelFetchError, BackendError, OSError, HostError,
            LockError) as exc:
        # configuration and environment problems: one clear line, no traceback
        print(f"prefixmesh node: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # e.g. the engine refusing the model file
        if type(exc).__module__.startswith("prefixmesh.inference"):
            print(f"prefixmesh node: error: {exc}", file=sys.stderr)
            return 1
        raise
    finally:
        if failed and backend is not None:
            # a load begun for a start that failed: let it end and close what it built
            # (a llama.cpp load still running in a thread would race the exit)
            with contextlib.suppress(Exception):
                trio.run(backend.aclose)
        for lock in reversed(locks):
            # a start that failed leaves no lock files or folders of its own behind
            lock.undo() if failed else lock.release()
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
    if node.signalled:
        # told to stop and everything is closed: skip the interpreter's own teardown
        # (libraries' atexit hooks and finalizers took 5 s on a loaded machine, after
        # the 3 s budget, where the watchdog thread can no longer run)
        exit_now(0, f"stopped in {node.stop_took_s:.2f} s", logging.INFO)
    return 0
