"""Rank processes forked from a per-node process that imported torch once.

A rank's process used to pay for its imports: Python, Ray's worker, torch and torch._dynamo
(which every torch.optim optimizer imports): ~2.5 s of CPU on a fast core, ~6 s on a slow
one, for every rank, spare, standby and replacement of every job. On a node that is what a
job's cold start and every replacement without a warm process wait for, and on a small
machine it was half of the CPU a short job took. Here one process per node (the zygote)
imports torch and torch._dynamo once and forks each rank's process from itself, as Python's
forkserver does; a forked process shares the zygote's pages and imports only Ray.

The rank stays an ordinary Ray actor. Ray starts a worker through the actor's
runtime_env `py_executable`: this module, run as `python -m stalwart.orchestrator.worker.
zygote <default_worker.py> <its arguments>`, is that command (the launcher). It asks the
node's zygote (over a Unix socket; it starts one if there is none) for a child running
Ray's default_worker.py with the launcher's arguments, environment, working directory and
standard streams; the child registers with the raylet as the worker (its own pid), and the
launcher waits for it, passes signals on and exits with its status. Either dying takes the
other down: the child watches the launcher (a pidfd), the zygote tells the launcher the
child's status. Anything unusual (no zygote within START_WAIT_S, one that went away) and the
launcher runs the worker itself, as Ray would have.

A zygote serves one raylet and one environment (its socket's name is a hash of the Python,
the raylet's socket and every environment variable but PER_WORKER_ENV): what the imports
read from the environment is the same in every child. It never touches a GPU (CUDA is
initialised by each child, after the fork), holds one thread when it forks, and exits once
its raylet is gone or after IDLE_EXIT_S without children.

This module imports nothing but the standard library at its top: the launcher runs it for
every rank.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import json
import os
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any

MODULE = "stalwart.orchestrator.worker.zygote"
# What the zygote imports before it forks (the collector paused, then frozen, as a rank's
# own imports are: worker/remote.py import_train_worker). Not Ray: its core library reads
# the worker's job id (RAY_JOB_ID) from the environment once, when it is loaded, so a child
# of a zygote that had imported it registered as a worker of the job that started the
# zygote, which the raylet then stopped as finished. Each child imports Ray itself.
IMPORTS = ("torch", "torch._dynamo")
# Set by Ray per worker and read by no import of IMPORTS: left out of the zygote's key.
PER_WORKER_ENV = frozenset({"RAY_JOB_ID"})
START_WAIT_S = 30.0  # a zygote's imports on a busy node; then the launcher runs the worker
IDLE_EXIT_S = 600.0
CHECK_S = 1.0  # how often a zygote looks for its raylet
MAX_REQUEST = 4 << 20


def command() -> str:
    """The runtime_env `py_executable` that starts a worker through the zygote."""
    return f"{sys.executable} -m {MODULE}"


def start_method(spec: Any) -> tuple[bool, str]:
    """Whether a job's workers fork from their node's zygote, and why (for its events).
    Never where the spec or the job (a Jobs API working_dir) has a runtime_env: the
    workers' interpreter and environment are its."""
    if spec.runtime_env or _job_runtime_env():
        return False, "the job has a runtime_env: its workers start in its own interpreter"
    if spec.resources.forks():
        return True, "workers fork from each node's zygote, which imported torch once"
    if spec.resources.start_method == "spawn":
        return False, "resources.start_method: spawn"
    return False, "a GPU job (resources.gpu > 0) spawns unless resources.start_method is fork"


def _job_runtime_env() -> bool:
    import ray

    if not ray.is_initialized():  # (asking would start or join a Ray)
        return False
    try:
        return bool(ray.get_runtime_context().runtime_env)
    except Exception:  # no Ray here: no job runtime_env either
        return False


def _arg(argv: list[str], name: str) -> str:
    prefix = f"--{name}="
    return next((a[len(prefix) :] for a in argv if a.startswith(prefix)), "")


def socket_path(argv: list[str], env: dict[str, str]) -> str:
    """The Unix socket of the zygote for this worker: one per raylet and environment, in
    this user's private directory (private_dir)."""
    kept = sorted((k, v) for k, v in env.items() if k not in PER_WORKER_ENV)
    text = json.dumps([sys.executable, _arg(argv, "raylet-name"), kept])
    key = hashlib.sha256(text.encode()).hexdigest()[:24]
    return os.path.join(private_dir(), f"zygote-{key}.sock")


def private_dir() -> str:
    """The directory of this user's zygotes' sockets: a zygote runs what a connection asks
    (and is told the environment, tokens included), so only its user may reach it. Made
    0700; one that is not this user's alone is refused (PermissionError). A Unix socket's
    path has room for ~100 bytes: under the system's temporary directory."""
    path = os.path.join(tempfile.gettempdir(), f"stalwart-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} is not a directory of this user's alone")
    return path


# --- the launcher: Ray's command for a worker ----------------------------------------------


def launch(argv: list[str]) -> None:
    """Run Ray's worker `argv` (default_worker.py and its arguments) in a child of this
    node's zygote; exit as it exits. Runs it in this process when no zygote answers."""
    env = dict(os.environ)
    try:
        path = socket_path(argv, env)
    except OSError:  # no private directory to be had: no zygote
        os.execv(sys.executable, [sys.executable, *argv])
    conn = _connect(path, argv, env)
    pid = None
    if conn is not None:
        request = json.dumps(
            {"argv": argv, "env": env, "cwd": os.getcwd(), "launcher": os.getpid()}
        ).encode()
        try:
            socket.send_fds(conn, [len(request).to_bytes(8, "big") + request], [0, 1, 2])
            reply = conn.makefile("rb")
            pid = int(reply.readline())
        except (OSError, ValueError):
            pid = None
    if pid is None:
        # No zygote: the worker starts here, importing what it needs itself.
        os.execv(sys.executable, [sys.executable, *argv])

    def forward(signum: int, _frame: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, forward)
    try:
        line = reply.readline()
        code = int(line) if line.strip() else 1
    except (OSError, ValueError):
        code = 1
    if code < 0:  # killed by a signal: so is this process, for whoever waits on it
        with contextlib.suppress(OSError, ValueError):  # SIGKILL's cannot be set
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if 0 <= code < 256 else 1)


def _connect(path: str, argv: list[str], env: dict[str, str]) -> socket.socket | None:
    deadline = time.monotonic() + START_WAIT_S
    spawned = None
    while time.monotonic() < deadline:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
            return conn
        except OSError:
            conn.close()
        if spawned is not None and spawned.poll():
            return None  # the zygote failed to start (its log says why): no waiting on it
        if spawned is None:
            # Several launchers may start one at once: the first to lock the socket's lock
            # file serves, the others exit (status 0) before importing anything.
            spawned = subprocess.Popen(
                [sys.executable, "-m", MODULE, "serve", path, _arg(argv, "raylet-name"),
                 env.get("RAY_RAYLET_PID", "")],
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=open(path + ".log", "ab"),  # noqa: SIM115 (the child keeps it)
                close_fds=True,
            )  # fmt: skip
        time.sleep(0.05)  # polling a socket a process is binding; bounded by the deadline
    return None


# --- the zygote ----------------------------------------------------------------------------


def serve(path: str, raylet_socket: str, raylet_pid: str) -> None:
    lock = open(path + ".lock", "a")  # noqa: SIM115 (held for the process's life)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return  # another zygote serves (or is starting): the launchers find it
    import gc
    import importlib

    gc.disable()
    for name in IMPORTS:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()
    gc.enable()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}
    idle_since = time.monotonic()
    try:
        while _raylet_alive(raylet_socket, raylet_pid):
            ready, _, _ = select.select([listener, wake_r], [], [], CHECK_S)
            if wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
            _reap(children)
            if listener in ready:
                own = (lock.fileno(), listener.fileno(), wake_r, wake_w)
                _accept(listener, children, own)
            if children:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > IDLE_EXIT_S:
                break
    finally:
        # Its socket and lock go with it; its log stays where it says something.
        for leftover in (path, path + ".lock"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)
        with contextlib.suppress(OSError):
            if os.path.getsize(path + ".log") == 0:
                os.unlink(path + ".log")


def _raylet_alive(raylet_socket: str, raylet_pid: str) -> bool:
    if raylet_socket and not os.path.exists(raylet_socket):
        return False
    if raylet_pid.isdigit():
        try:
            os.kill(int(raylet_pid), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
    return True


def _reap(children: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            conn.close()


def _accept(listener: socket.socket, children: dict[int, socket.socket], own: tuple) -> None:
    conn, _ = listener.accept()
    fds: list[int] = []
    try:
        # Only this user's launchers (the directory is private too).
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        if struct.unpack("3i", creds)[1] != os.getuid():
            raise OSError("a connection from another user")
        conn.settimeout(10)
        data, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 3)
        size = int.from_bytes(data[:8], "big")
        body = data[8:]
        while len(body) < size:
            more = conn.recv(size - len(body))
            if not more:
                raise OSError("the launcher went away")
            body += more
        request = json.loads(body)
        conn.settimeout(None)
    except (OSError, ValueError):
        for fd in fds:
            os.close(fd)
        conn.close()
        return
    pid = os.fork()
    if pid == 0:
        # Nothing of the zygote's stays open in the child: its lock, socket and the other
        # launchers' connections (their end would not see the zygote go).
        _child(request, fds, conn, (*own, *(c.fileno() for c in children.values())))
    for fd in fds:
        os.close(fd)
    try:
        conn.sendall(f"{pid}\n".encode())
    except OSError:  # the launcher is gone: so goes its child (it watches the launcher)
        conn.close()
        return
    children[pid] = conn


def _child(request: dict, fds: list[int], conn: socket.socket, own: tuple) -> None:
    """In the forked process: become the launcher's worker. Never returns."""
    code = 1
    try:
        for fd in own:
            os.close(fd)
        conn.close()
        # A process group of its own, as Ray gives every worker: the raylet kills a
        # disconnected worker's group, which would otherwise be the zygote's and every
        # sibling's.
        os.setpgid(0, 0)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        # The import path the worker's own interpreter would have started with.
        for entry in reversed(request["env"].get("PYTHONPATH", "").split(os.pathsep)):
            if entry and entry not in sys.path:
                sys.path.insert(0, entry)
        _reseed()
        _watch(request["launcher"])
        sys.argv = list(request["argv"])
        import runpy

        runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # reported on the worker's stderr, then the exit
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        os._exit(code)


def _reseed() -> None:
    """A fresh process's random states (Python's own reseeds itself at a fork)."""
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()


def _watch(launcher: int) -> None:
    """Exit when the launcher does (the raylet killed the worker's process it knows)."""
    import threading

    try:
        fd = os.pidfd_open(launcher)
    except (OSError, AttributeError):
        return

    def wait() -> None:
        select.select([fd], [], [])
        os._exit(1)

    threading.Thread(target=wait, name="stalwart-launcher-watch", daemon=True).start()


def serves(pid: int) -> int | None:
    """The raylet pid the zygote `pid` serves (None if `pid` is no zygote)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return None
    if MODULE.encode() not in argv or b"serve" not in argv or not argv[-2:-1]:
        return None
    raylet = argv[-2].decode(errors="replace")
    return int(raylet) if raylet.isdigit() else None


def zygotes_of(raylet_pid: int) -> list[int]:
    """The pids of the zygotes serving the raylet `raylet_pid` on this machine."""
    return [
        int(entry)
        for entry in os.listdir("/proc")
        if entry.isdigit() and serves(int(entry)) == raylet_pid
    ]


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(*sys.argv[2:5])
    else:
        launch(sys.argv[1:])
