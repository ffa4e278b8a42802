"""Ranks that start without importing torch again: a fork server for the suite's MPI jobs.

Every rank of every job pays for ``import torch`` (seconds of CPU) before its first line of
work; the suite starts a few hundred ranks on two cores. Here each rank index of a test
process has a server that imported torch and numpy once (never MPI, never mpisync) and
forks a copy of itself per rank. ``mpiexec`` still starts one process per rank, this file as
a client: it hands the server its arguments, environment, working directory and the
descriptors the MPI launcher gave it (stdin, stdout, stderr, MPICH's ``PMI_FD``); the
fork becomes the rank (``MPI_Init``, the script as ``__main__``, its exit), and the client
ends as the rank ended: with its exit status, or killed by its signal. A signal sent to the
client reaches the rank; a client that dies (the launcher ending the job) takes the rank
with it; a server whose test process is gone ends with its ranks.

Each rank is a real MPI process: only how it was created differs. It differs from a fresh
Python in what was decided when the server started: the modules imported (torch, numpy),
their import-time environment (a job whose environment differs in anything but
``MPISYNC_*`` and its result directory is started the usual way), and the hash seed (one
server per rank index, so the ranks of a job still hash strings differently). NumPy's global
generator is seeded afresh in each rank, as in a new process.

    python tests/forkserver.py serve SOCKET PID  # a server for process PID: prints "ready"
    python tests/forkserver.py SOCKET_DIR SCRIPT ARGS...   # a rank (what mpiexec runs)
"""
from __future__ import annotations

import array
import json
import os
import signal
import socket
import struct
import sys

# Descriptors a rank is given by its launcher, besides stdin, stdout and stderr: the
# environment variables that name them (MPICH's simple PMI).
FD_VARIABLES = ("PMI_FD",)
# Signals the client passes on to its rank.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGQUIT, signal.SIGALRM)
_HEADER = struct.Struct("!I")


def _send(sock: socket.socket, payload: dict, fds: list[int] = ()) -> None:
    data = json.dumps(payload).encode()
    ancillary = ([(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                 if fds else [])
    sock.sendmsg([_HEADER.pack(len(data)), data], ancillary)


def _receive(sock: socket.socket) -> tuple[dict, list[int]]:
    fds = array.array("i")
    head, ancillary, _flags, _addr = sock.recvmsg(
        _HEADER.size, socket.CMSG_LEN(16 * fds.itemsize))
    if len(head) < _HEADER.size:
        raise EOFError("the peer closed the connection")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    (size,) = _HEADER.unpack(head)
    body = b""
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        if not chunk:
            raise EOFError("the peer closed the connection")
        body += chunk
    return json.loads(body), list(fds)


# --- the client: what mpiexec starts ------------------------------------------------------

def client(socket_dir: str, argv: list[str]) -> None:
    """Have this rank's server fork the rank; end as it ended."""
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(os.path.join(socket_dir, str(rank)))
    targets = [0, 1, 2] + [int(os.environ[v]) for v in FD_VARIABLES if v in os.environ]
    _send(sock, {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(),
                 "targets": targets}, targets)
    pid = _receive(sock)[0]["pid"]

    def forward(signum: int, _frame) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:      # the rank ended meanwhile: its end is on its way
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    try:
        end = _receive(sock)[0]
    except (EOFError, ConnectionError):
        end = {"signal": signal.SIGKILL}        # the server is gone, and the rank with it
    if "signal" in end:
        if end["signal"] not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(end["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), end["signal"])
    os._exit(end.get("code", 1))


# --- the server ---------------------------------------------------------------------------

def serve(path: str, parent: int) -> None:
    """Accept clients; fork a rank for each; tell each client how its rank ended. Ends
    when its ``parent`` (the test process) does."""
    import selectors

    _die_with_parent()
    if os.getppid() != parent:                      # gone before the line above
        return
    import numpy  # noqa: F401 (imported once here, for every rank)
    import torch  # noqa: F401

    if os.path.exists(path):                        # a server before this one died
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    ranks: dict[int, socket.socket] = {}          # pid -> its client's connection
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    print("ready", flush=True)
    while os.getppid() == parent:
        for key, _ in selector.select(timeout=0.02):
            if key.fileobj is listener:
                _accept(listener, ranks, selector)
            else:                                   # a client closed: end its rank
                _kill(key.data)
        _reap(ranks, selector)
    for pid in ranks:                               # the test process is gone
        _kill(pid)


def _accept(listener: socket.socket, ranks: dict[int, socket.socket], selector) -> None:
    import selectors

    conn, _ = listener.accept()
    try:
        request, fds = _receive(conn)
    except (EOFError, ConnectionError):
        conn.close()
        return
    pid = os.fork()
    if pid == 0:
        _become_rank(request, fds, [listener, conn, *ranks.values()])   # never returns
    for fd in fds:
        os.close(fd)
    ranks[pid] = conn
    selector.register(conn, selectors.EVENT_READ, pid)
    _send(conn, {"pid": pid})


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(ranks: dict[int, socket.socket], selector) -> None:
    """Tell the client of each rank that ended how it ended."""
    while ranks:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = ranks.pop(pid, None)
        if conn is None:
            continue
        selector.unregister(conn)
        end = ({"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status)
               else {"code": os.WEXITSTATUS(status)})
        try:
            _send(conn, end)
        except OSError:
            pass
        conn.close()


def _die_with_parent() -> None:
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _become_rank(request: dict, fds: list[int], sockets: list[socket.socket]) -> None:
    """In the fork: take the client's descriptors, environment and script, and run it."""
    import fcntl

    for sock in sockets:
        sock.close()
    _die_with_parent()
    for signum in (*FORWARDED, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 1000) for fd in fds]
    for fd in fds:
        os.close(fd)
    for fd, target in zip(high, request["targets"]):
        os.dup2(fd, target)                         # inheritable, as the launcher made them
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    _streams(unbuffered=bool(request["env"].get("PYTHONUNBUFFERED")))
    import numpy
    numpy.random.seed()                             # a fresh process's fresh seed
    script, *args = request["argv"]
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    sys.exit(_run(script))


_KEPT: list = []      # the server's own streams: collected, they would close fds 0, 1 and 2


def _streams(unbuffered: bool) -> None:
    """New ``sys.stdin``, ``stdout`` and ``stderr`` over the rank's descriptors, encoded and
    buffered as Python makes them for a script: ``PYTHONUNBUFFERED`` writes through;
    otherwise ``stderr`` is buffered by line, ``stdout`` by line on a terminal only."""
    old = (sys.stdin, sys.stdout, sys.stderr)
    _KEPT.extend(old)
    new = [open(fd, "w" if fd else "r", encoding=stream.encoding,  # noqa: SIM115
                errors=stream.errors, closefd=False) for fd, stream in enumerate(old)]
    for fd, stream in enumerate(new[1:], start=1):
        stream.reconfigure(write_through=unbuffered,
                           line_buffering=not unbuffered and (fd == 2 or os.isatty(fd)))
    sys.stdin, sys.stdout, sys.stderr = new
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = new


def _run(script: str) -> int:
    """Run ``script`` as ``__main__``, as ``python script`` does; its exit status."""
    import runpy
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        raise stop from None
    except BaseException as error:  # noqa: BLE001 (what Python does with an uncaught one)
        tb = error.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != script:
            tb = tb.tb_next                         # from the script's own frame, as Python
        tb = tb or error.__traceback__
        sys.excepthook(type(error), error.with_traceback(tb), tb)
        if isinstance(error, KeyboardInterrupt):
            sys.stdout.flush()
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        return 1
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        client(sys.argv[1], sys.argv[2:])
