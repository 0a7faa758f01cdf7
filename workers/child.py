"""Child processes of an engine: one way to launch, hand-shake, name, watch and clean up.

Every kind of helper process (I/O workers, the evictor, the store scanner)
starts and lives the same way, so the rules are written once here:

    parent (engine)                              child (python -m <module>)
    ---------------                              --------------------------
    Child(module, name, spec_json) ──Popen──►    child_main(): process name (prctl),
      PYTHONPATH = this package's root,            parse the spec, run the body
      OPENBLAS_NUM_THREADS = 1,
      stdin closed, only pass_fds inherited      body publishes its pid in a control
    child.ready() / wait_ready() ◄──────────────   word (the ready handshake)
      reads that word: a pid equal to ours
    child.alive(), kill(), reap()                ParentWatch.gone(): the parent's pid
                                                   changed (we were reparented)
                                                 orphan_cleanup(): unlink the names
                                                   the parent would have unlinked
                                                 os._exit(the body's code): no teardown

`subprocess` gives spawn semantics (fresh interpreter: no CUDA state, no
inherited locks) and also works from a daemonic multiprocessing parent, where
multiprocessing refuses to start children.

Must not know what a child does, nor what its control words mean beyond
"this word holds the pid of a ready child".
"""
import ctypes
import os
import select
import subprocess
import sys
import time
from typing import NoReturn

from shm.libc import loader
from shm.names import unlink_names
from workers.timing import CHILD_READY_POLL_S, PARENT_EXIT_S

# libc called with the GIL held (PyDLL): see Child.alive
_libc = loader(ctypes.PyDLL, {
    "waitpid": (ctypes.c_int, [ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_int]),
})

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ChildStartError(RuntimeError):
    """A child process exited, or did not say ready in time."""


class Child:
    """The parent's handle on one child process.

    `ready_word`: a zero-argument callable returning the pid the child has
    published as ready (0 until then). The caller zeroes the word before the
    launch, so a previous child's pid never reads as ready.
    """

    def __init__(self, module: str, name: str, spec_json: str, *, ready_word,
                 pass_fds: tuple = ()):
        env = dict(os.environ)
        env["PYTHONPATH"] = _PACKAGE_ROOT + os.pathsep + env.get("PYTHONPATH", "")
        # No child does linear algebra, yet numpy's import starts OpenBLAS's thread
        # pool (a thread per core but one, each with its buffers): with one thread
        # a child starts ~40 ms of CPU sooner and holds no idle threads.
        env["OPENBLAS_NUM_THREADS"] = "1"
        self.name = name
        self._ready_word = ready_word
        self._ready = False
        self.started = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", module, name, spec_json], env=env,
                                     stdin=subprocess.DEVNULL, close_fds=True, pass_fds=pass_fds)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self):
        return self.proc.returncode

    def alive(self) -> bool:
        """False once the child has exited (and been reaped: one waitpid, WNOHANG).

        libc's waitpid through ctypes.PyDLL keeps the GIL, where os.waitpid
        (Popen.poll) gives it up even with WNOHANG: the health check asks
        about every child ten times a second from the scheduler's threads,
        and under a busy scheduler each release costs a switch interval."""
        if self.proc.returncode is not None:
            return False
        status = ctypes.c_int(0)
        got = _libc().waitpid(self.proc.pid, ctypes.byref(status), os.WNOHANG)
        if got == 0:
            return True
        if got == self.proc.pid:
            self.proc.returncode = os.waitstatus_to_exitcode(status.value)
            return False
        return self.proc.poll() is None  # ECHILD or EINTR: let Popen sort it out

    def ready(self) -> bool:
        """Non-blocking: has the child said ready? Raises ChildStartError if it died first."""
        if self._ready:
            return True
        if int(self._ready_word()) == self.proc.pid:
            self._ready = True
            return True
        if self.proc.poll() is not None:
            raise ChildStartError(f"{self.name} exited with code {self.proc.returncode} before "
                                  f"it was ready (see its stderr above)")
        return False

    def check_start(self, timeout_s: float) -> bool:
        """ready(), plus a start deadline: ChildStartError once `timeout_s` has passed."""
        if self.ready():
            return True
        if time.monotonic() - self.started > timeout_s:
            raise ChildStartError(f"{self.name} not ready after {timeout_s}s")
        return False

    def kill(self) -> None:
        """SIGKILL, no wait (a child stuck in the kernel dies when its syscall returns)."""
        if self.proc.returncode is None:
            try:
                self.proc.kill()
            except OSError:
                pass

    def stop(self, deadline: float) -> None:
        """Wait for an exit until `deadline` (monotonic), then SIGKILL and reap."""
        try:
            self.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def wait_ready(children, timeout_s: float) -> None:
    """Block until every child has said ready; ChildStartError on an exit or the deadline."""
    pending = list(children)
    while pending:
        pending = [c for c in pending if not c.check_start(timeout_s)]
        if pending:
            time.sleep(CHILD_READY_POLL_S)


# --- the child's side -------------------------------------------------------------
class ParentWatch:
    """Has the process that started us gone? (We are reparented when it dies.)

    Gone means exited to the end, so that what the kernel releases at its
    death is released: the flock of its owner lock file above all, which the
    orphan clean-up takes before it removes the lock file (shm.names). A
    parent's children are reparented by the first of its exiting threads
    that finds every other one exiting too, and another may still be tearing
    down the address space before it drops the descriptor table: with a
    large address space the lock stayed held for 250 ms after the reparent
    (in 8 of 60 kills of a 2 GB process with two threads), the orphans took
    the owner for alive, and its lock file stayed in /dev/shm until the next
    engine's start. So once reparented, gone() waits (at most PARENT_EXIT_S)
    for the parent's pidfd, opened here while the parent lived, to report
    that its last thread has exited. Without pidfds (Linux before 5.3, a
    seccomp filter that refuses pidfd_open), or where the parent died before
    we could open one, gone() is the reparent alone, as it was."""

    def __init__(self, parent_pid: int):
        self.parent_pid = parent_pid
        self._exit_fd = _exit_fd(parent_pid)

    def gone(self) -> bool:
        if os.getppid() == self.parent_pid:
            return False
        if self._exit_fd is not None:
            poller = select.poll()
            poller.register(self._exit_fd, select.POLLIN)
            poller.poll(PARENT_EXIT_S * 1000)  # readable once its last thread exited
        return True


def _exit_fd(pid: int):
    """A pidfd of `pid`, our parent, or None. Opened after the parent died,
    a pid may name another process: only one opened while getppid() still
    names it is the parent's."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None
    if os.getppid() != pid:
        os.close(fd)
        return None
    return fd


def set_process_name(name: str) -> None:
    """Best effort: show the child's name in top/ps (comm); argv carries it anyway."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except Exception:
        pass


def orphan_cleanup(shm_names, sem_names) -> None:
    """An orphan unlinks what its dead parent would have: nothing stays in /dev/shm."""
    unlink_names(shm_names, sem_names)


def child_main(argv: list[str], parse, body) -> NoReturn:
    """Entry point of a child: `argv` is [prog, name, spec_json]; runs
    body(parse(spec_json)) and exits with the code it returns.

    The exit skips the interpreter's teardown (modules freed one by one,
    numpy's among them: 20-50 ms), which every close() waits for, since it
    waits for each child to exit. The body has joined its threads and closed
    or unlinked what it must by then; only Python's own buffers are left to
    flush. A body that raises exits the ordinary way, with its traceback."""
    name, spec_json = argv[1], argv[2]
    set_process_name(name)
    code = body(parse(spec_json))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
