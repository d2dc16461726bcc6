"""Test helper: start node processes by forking a pre-imported interpreter.

A node process spends most of its ~2.7 s start in Python imports (libp2p alone ~1.4 s),
and the suite starts ~80 of them. The fork server is one helper process per test session
that imports the node's code once (``tests/_fault_node.py``, the daemon, libp2p, trio, the
CLI) and then, per node start, forks a child that runs exactly what
``python tests/_fault_node.py ARGS`` or ``prefixmesh ARGS`` runs: the same ``main`` with
the same ``sys.argv``, the caller's environment, working directory, umask, open-files
limit, stdin, stdout and stderr, and normal interpreter exit (atexit, flushing, the exit status of ``SystemExit``).
The child is its own process: ``pid`` is its pid, so SIGSTOP/SIGKILL/SIGTERM reach the node
itself; the server reaps it and reports its exit status, which :class:`ForkedProc` (the
``subprocess.Popen`` subset the tests use) returns from ``poll``/``wait``.

What differs from a fresh interpreter: the children share the server's hash seed, and they
import nothing at start (the model, llama.cpp and all state of the node are loaded in the
child, as before). The fork happens in a single-threaded server that has never run trio
(checked before every fork); ``random`` reseeds itself after a fork and trio's scheduler
RNG is reseeded here. Environment variables read at interpreter start or library load
(``PYTHON*``, ``OMP_*``, ``OPENBLAS_*``, ``MKL_*``, ``LD_*``, ``MALLOC_*``) must equal the
server's, otherwise (and for any other command line, e.g. ``ip netns exec``) the caller
starts the process with ``subprocess.Popen`` as before. ``PREFIXMESH_TEST_FORKSERVER=0``
turns the fork server off.

Run as a script, this file is the server: ``python tests/_forkserver.py SOCKET_PATH``.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import struct
import subprocess
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
FAULT_NODE = os.path.join(_HERE, "_fault_node.py")
# environment variables read when the interpreter starts or a library loads: a child
# forked from the server has the server's values, so they must be the same
_STARTUP_ENV_PREFIXES = ("PYTHON", "OMP_", "OPENBLAS_", "GOTO", "MKL_", "LD_", "MALLOC_")
_MAX_REQUEST_BYTES = 4 << 20
_FDS = 3  # stdin, stdout, stderr of the node


def _startup_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_STARTUP_ENV_PREFIXES)}


# --- the server (this file run as a script) ------------------------------------------------


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds = b"", []
    while len(data) < 4 or len(data) < 4 + struct.unpack("!I", data[:4])[0]:
        chunk, ancdata, _flags, _addr = conn.recvmsg(65536, socket.CMSG_SPACE(_FDS * 4))
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += list(struct.unpack(f"{len(payload) // 4}i", payload[: len(payload) // 4 * 4]))
        if not chunk:
            raise ConnectionError("request cut short")
        data += chunk
        if len(data) > _MAX_REQUEST_BYTES:
            raise ValueError("request too large")
    return json.loads(data[4:]), fds


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _serve(sock_path: str) -> dict:
    """Serve fork requests until stdin closes (the test process ended). Returns, in a
    forked child only, that child's request (the caller runs it)."""
    import selectors

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector through wake_w
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "child")
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "stdin")
    children: dict[int, socket.socket] = {}
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        for key, _ in sel.select():
            if key.data == "stdin":
                if not os.read(sys.stdin.fileno(), 4096):
                    raise SystemExit(0)
            elif key.data == "child":
                while True:
                    try:
                        if not os.read(wake_r, 4096):
                            break
                    except BlockingIOError:
                        break
                while True:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    conn = children.pop(pid, None)
                    if conn is not None:
                        try:
                            conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                        except OSError:
                            pass
                        conn.close()
            else:
                conn, _ = listener.accept()
                try:
                    request, fds = _recv_request(conn)
                    if len(fds) != _FDS:
                        raise ValueError(f"expected {_FDS} file descriptors, got {len(fds)}")
                    if _threads() != 1:
                        raise RuntimeError(f"fork server has {_threads()} threads")
                except (OSError, ValueError, RuntimeError) as exc:
                    try:
                        conn.sendall(f"error {exc}\n".encode())
                    except OSError:
                        pass
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    # the child: drop everything of the server, take the node's fds
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    sel.close()
                    for other in children.values():
                        other.close()
                    listener.close()
                    conn.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    for target, fd in enumerate(fds):
                        os.dup2(fd, target)
                    for fd in set(fds):
                        if fd > 2:
                            os.close(fd)
                    return request
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                try:
                    conn.sendall(f"pid {pid}\n".encode())
                except OSError:
                    pass


def _run_child(request: dict) -> None:
    """Become the requested program, as its own interpreter would run it."""
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    resource.setrlimit(resource.RLIMIT_NOFILE, tuple(request["nofile"]))
    os.environ.clear()
    os.environ.update(request["env"])
    try:  # trio's scheduler RNG (``random`` reseeds itself after a fork)
        import trio._core._run as trio_run

        trio_run._r.seed()
    except (ImportError, AttributeError):
        pass
    sys.argv = list(request["argv"])
    if request["program"] == "fault_node":
        import _fault_node

        raise SystemExit(_fault_node.main())
    from prefixmesh.cli import main

    raise SystemExit(main())


def _server_main(sock_path: str) -> None:
    # what a node imports before it does anything (its own code, libp2p, trio, the CLI);
    # nothing here may start a thread
    import _fault_node  # noqa: F401

    import prefixmesh.cli  # noqa: F401

    if _threads() != 1:
        raise SystemExit(f"fork server: {_threads()} threads after imports; not forking")
    _run_child(_serve(sock_path))


# --- the client (imported by tests/_swarm.py) ------------------------------------------------


class ForkedProc:
    """A node process forked by the server: the ``subprocess.Popen`` subset the tests use
    (``pid``, ``stdout``, ``args``, ``returncode``, ``poll``, ``wait``, ``send_signal``,
    ``terminate``, ``kill``)."""

    def __init__(self, conn: socket.socket, args: list[str], stdout, timeout_s: float):
        import threading

        self.args = args
        self.stdout = stdout
        self.returncode: int | None = None
        self._conn = conn
        self._exited = threading.Event()
        conn.settimeout(timeout_s)
        reader = conn.makefile("r", encoding="ascii")
        first = reader.readline().split()
        if len(first) != 2 or first[0] != "pid":
            conn.close()
            raise RuntimeError(f"fork server refused: {' '.join(first) or 'no answer'}")
        self.pid = int(first[1])
        conn.settimeout(None)

        def wait_exit() -> None:
            line = reader.readline().split()
            if len(line) == 2 and line[0] == "exit":
                self.returncode = int(line[1])
            else:  # the server went away: wait for the process itself
                import time

                while os.path.exists(f"/proc/{self.pid}"):
                    time.sleep(0.1)
                self.returncode = 255
            conn.close()
            self._exited.set()

        threading.Thread(target=wait_exit, daemon=True, name=f"forked-{self.pid}").start()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The session's server process, started at the first :func:`spawn` that can use it."""

    def __init__(self, env: dict[str, str]):
        import subprocess
        import tempfile
        import threading

        self._dir = tempfile.mkdtemp(prefix="pm-forkserver-")
        self.nofile_hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        self._owner = os.getpid()  # a forked copy of the test process must not close it
        self.sock_path = os.path.join(self._dir, "sock")
        self.env = dict(env)
        self.log_path = os.path.join(self._dir, "server.log")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, __file__, self.sock_path],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, env=self.env, cwd=_HERE)
        ready = threading.Event()

        def read_ready() -> None:
            if self.proc.stdout.readline().strip() == b"ready":
                ready.set()

        threading.Thread(target=read_ready, daemon=True).start()
        if not ready.wait(60.0):
            self.close()
            raise RuntimeError(f"fork server did not start; log: {self._log_tail()}")

    def _log_tail(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-2000:]
        except OSError:
            return ""

    def fits(self, env: dict[str, str]) -> bool:
        # the child takes the caller's open-files limit: it cannot raise the hard one
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        return self.proc.poll() is None and _startup_env(env) == _startup_env(self.env) and \
            (self.nofile_hard == resource.RLIM_INFINITY or
             hard != resource.RLIM_INFINITY and hard <= self.nofile_hard)

    def spawn(self, program: str, argv: list[str], args: list[str], env: dict[str, str],
              stderr_fd: int, stdin_fd: int | None = None,
              cwd: str | None = None) -> ForkedProc:
        read_fd, write_fd = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(30.0)
            conn.connect(self.sock_path)
            body = json.dumps({"program": program, "argv": argv, "env": env,
                               "cwd": os.path.abspath(cwd or os.getcwd()), "umask": _umask(),
                               "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)}).encode()
            message = struct.pack("!I", len(body)) + body
            # the caller's stdin, else fd 0 itself (under pytest sys.stdin is a stand-in
            # without a file descriptor)
            own_stdin = stdin_fd is None and not _fd_open(0)
            if stdin_fd is None:
                stdin_fd = os.open(os.devnull, os.O_RDONLY) if own_stdin else 0
            fds = [stdin_fd, write_fd, stderr_fd]
            try:
                conn.sendmsg([message[:65536]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                  struct.pack(f"{_FDS}i", *fds))])
            finally:
                if own_stdin:
                    os.close(stdin_fd)
            if len(message) > 65536:
                conn.sendall(message[65536:])
        except BaseException:
            conn.close()
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        stdout = open(read_fd, encoding=None)  # text, universal newlines: as Popen(text=True)
        try:
            return ForkedProc(conn, args, stdout, 30.0)
        except BaseException:
            stdout.close()
            raise

    def close(self) -> None:
        import shutil

        if os.getpid() != self._owner:
            return
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the server exits at EOF
            try:
                self.proc.wait(5)
            except Exception:  # noqa: BLE001 - a server that hangs is killed
                self.proc.kill()
        shutil.rmtree(self._dir, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


_server: ForkServer | None = None
_server_failed = False


def program_for(args: list[str]) -> tuple[str, list[str]] | None:
    """(program, sys.argv) when ``args`` is a command line the server can run: the test
    entry point ``python tests/_fault_node.py ...`` or the ``prefixmesh`` console script
    (also as ``python -m prefixmesh``); None otherwise."""
    args = [str(a) for a in args]
    if len(args) >= 2 and args[0] == sys.executable and os.path.abspath(args[1]) == FAULT_NODE:
        return "fault_node", args[1:]
    script = os.path.join(os.path.dirname(sys.executable), "prefixmesh")
    if args and args[0] == script:
        return "cli", args
    if args[:3] == [sys.executable, "-m", "prefixmesh"]:
        import prefixmesh

        return "cli", [os.path.join(os.path.dirname(prefixmesh.__file__), "__main__.py"),
                       *args[3:]]
    return None


def spawn(args: list[str], env: dict[str, str], stderr_fd: int,
          server_env: dict[str, str], stdin_fd: int | None = None,
          cwd: str | None = None) -> ForkedProc | None:
    """Start ``args`` with environment ``env`` and stderr ``stderr_fd`` through the
    session's fork server (started with ``server_env`` the first time: the environment
    common to all nodes); None when it cannot (another command line, other start-up
    variables, the server off or broken): the caller then starts the process itself."""
    global _server, _server_failed
    program = program_for(args)
    if program is None or _server_failed or os.environ.get("PREFIXMESH_TEST_FORKSERVER") == "0":
        return None
    if _server is None:
        try:
            _server = ForkServer(server_env)
        except (OSError, RuntimeError) as exc:
            _server_failed = True
            print(f"tests/_forkserver: not used ({exc})", file=sys.stderr)
            return None
        import atexit

        atexit.register(_server.close)
    if not _server.fits(env):
        return None
    try:
        return _server.spawn(program[0], program[1], list(args), env, stderr_fd, stdin_fd, cwd)
    except (OSError, RuntimeError) as exc:  # this start goes without; a dead server for good
        _server_failed = _server.proc.poll() is not None
        print(f"tests/_forkserver: not used ({exc}); log: {_server._log_tail()}",
              file=sys.stderr)
        return None


# what tests/_swarm.py gives every node (and so the server): unbuffered output, one OpenMP
# thread; a command run through :func:`run` gets the same start-up variables
NODE_STARTUP_ENV = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def run(args: list[str], *, env: dict[str, str] | None = None, timeout: float | None = None,
        cwd=None, stdin_devnull: bool = False) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(args, capture_output=True, text=True, ...)`` for a ``prefixmesh``
    command line, forked from the session's server where it can be (a CLI process spends
    ~1-2 s of CPU in imports; forked, none), else run by ``subprocess.run``. ``env``: the
    whole environment, as ``subprocess.run`` takes it (default: ours); the start-up
    variables of :data:`NODE_STARTUP_ENV` are added where it does not set them (output is
    captured through pipes either way; the CLI's answers do not depend on either).
    ``stdin_devnull``: stdin is /dev/null (else the caller's fd 0)."""
    import threading

    env = {**NODE_STARTUP_ENV, **(os.environ if env is None else env)}
    stdin = subprocess.DEVNULL if stdin_devnull else None
    err_r, err_w = os.pipe()
    null_fd = os.open(os.devnull, os.O_RDONLY) if stdin_devnull else None
    try:
        proc = spawn(args, env, err_w, dict(os.environ, **NODE_STARTUP_ENV), null_fd,
                     None if cwd is None else str(cwd))
    finally:
        os.close(err_w)
        if null_fd is not None:
            os.close(null_fd)
    if proc is None:
        os.close(err_r)
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=cwd, stdin=stdin)
    captured: dict[str, str] = {}

    def drain(name: str, stream) -> None:
        with stream:
            captured[name] = stream.read()

    readers = [threading.Thread(target=drain, args=("stdout", proc.stdout), daemon=True),
               threading.Thread(target=drain, args=("stderr", open(err_r)), daemon=True)]
    for reader in readers:
        reader.start()
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired as exc:  # as subprocess.run: killed, output kept
        proc.kill()
        proc.wait()
        for reader in readers:
            reader.join(10)
        exc.stdout, exc.stderr = captured.get("stdout", ""), captured.get("stderr", "")
        raise
    for reader in readers:
        reader.join(10)
    return subprocess.CompletedProcess(args, rc, captured.get("stdout", ""),
                                       captured.get("stderr", ""))


if __name__ == "__main__":
    _server_main(sys.argv[1])
