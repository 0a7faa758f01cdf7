"""Wake-ups: a named POSIX semaphore that idle workers sleep on.

Owns the sleep/post protocol. The scheduler posts once per batch, never once
per page; a sleeper wakes on a post or after a timeout (so it can check on its
parent). The sleep is libc's sem_timedwait, called with the GIL released, so
a thread blocked here never starves the scheduler. A signal that interrupts
the sleep (any process with a Python signal handler, as servers have) resumes
it within the same deadline once its handler returns: a wait ends only on a
post, on its timeout, or with what the handler raised (SystemExit from a
SIGTERM handler's sys.exit, KeyboardInterrupt), which reaches the caller
(decision 99). Must not carry data: the rings do that.

Closing is safe at any point of another call, also from a signal handler
that interrupted a wait on the same thread: a closed semaphore ends every
wait at once (as a timeout), posts nothing and has nothing pending; its name
goes at once, its handles only once no call is inside them (closing a handle
a thread sleeps on, or is about to try, is undefined behaviour in POSIX).
"""
import ctypes
import errno
import functools
import os
import threading
import time

import posix_ipc

from .libc import loader

# libc called with the GIL held (PyDLL): sem_trywait and sem_post never block,
# and posix_ipc gives the GIL up even for those.
_libc = loader(ctypes.PyDLL, {
    "sem_open": (ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_int]),
    "sem_trywait": (ctypes.c_int, [ctypes.c_void_p]),
    "sem_post": (ctypes.c_int, [ctypes.c_void_p]),
    "sem_close": (ctypes.c_int, [ctypes.c_void_p]),
})

_SEM_FAILED = ctypes.c_void_p(-1).value


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


# The sleep, with the GIL released (CDLL). Not posix_ipc's acquire(): on EINTR
# it runs the Python signal handler itself (PyErr_CheckSignals) and then
# replaces whatever the handler raised, but KeyboardInterrupt, by SignalError,
# with no trace of it (no __context__): a SIGTERM handler's sys.exit() was
# lost, and the server ran on. Called through ctypes, the interrupted call
# just returns -1/EINTR; the interpreter runs the handler as the call returns,
# in the waiting frame, so what it raises propagates like any exception.
_sleeping_libc = loader(ctypes.CDLL, {
    "sem_wait": (ctypes.c_int, [ctypes.c_void_p]),
    "sem_timedwait": (ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(_Timespec)]),
})


@functools.cache
def _sleeper():
    """libc's sleeping calls, or None where it has none (no sem_timedwait:
    macOS); there posix_ipc's acquire() sleeps, and a handler's exception
    other than KeyboardInterrupt is lost (posix_ipc drops it)."""
    try:
        return _sleeping_libc()
    except (OSError, AttributeError):
        return None


def _deadline(left: float):
    """sem_timedwait's absolute deadline `left` seconds from now, on its clock
    (CLOCK_REALTIME)."""
    ns = time.time_ns() + int(left * 1e9)
    return ctypes.byref(_Timespec(ns // 1_000_000_000, ns % 1_000_000_000))


def _outcome(rc: int) -> bool | None:
    """What a libc sem_wait, sem_timedwait or sem_trywait returned: True
    taken, False timed out (or nothing pending), None interrupted by a signal
    (EINTR: the handler has run and returned; one that raised never gets here)."""
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EINTR:
        return None
    if err in (errno.ETIMEDOUT, errno.EAGAIN):
        return False
    if err in (errno.EINVAL, errno.EBADF):
        raise posix_ipc.ExistentialError("The semaphore does not exist")  # as posix_ipc says it
    raise OSError(err, os.strerror(err))


class WakeSemaphore:
    def __init__(self, name: str, *, create: bool, mode: int = 0o600):
        self.name = name
        self.owner = create
        self._raw = None  # libc handle (sleep, post, trywait), opened on first use
        # Calls inside a handle now, and whether close() came: the handles go
        # when the last of them leaves. Reentrant: close() may run in a signal
        # handler on a thread that is inside wait().
        self._guard = threading.RLock()
        self._inside = 0
        self._closed = False
        self._handles_open = True
        if create:
            self._sem = posix_ipc.Semaphore("/" + name, posix_ipc.O_CREX, mode=mode, initial_value=0)
        else:
            self._sem = posix_ipc.Semaphore("/" + name)

    @property
    def closed(self) -> bool:
        return self._closed

    def post(self) -> None:
        """One post: libc's sem_post with the GIL held (a posix_ipc release
        gives the GIL up, and a busy scheduler makes the poster wait a
        switch interval to get it back). Nothing once closed: nobody is left
        to wake."""
        if not self._enter():
            return
        try:
            raw = self._raw_handle()
            if not raw or _libc().sem_post(raw) != 0:
                self._sem.release()  # no libc handle here: posix_ipc's post
        finally:
            self._leave()

    def _raw_handle(self):
        """This process's libc handle of the named semaphore (opened on first
        use; 0 where the platform has none). Called between _enter and _leave."""
        if self._raw is None:
            raw = _libc().sem_open(("/" + self.name).encode(), 0)
            self._raw = raw if raw not in (None, _SEM_FAILED) else 0
        return self._raw

    def take_pending(self) -> int:
        """Consume every post pending now without giving the GIL up (libc's
        sem_trywait on this process's own handle of the named semaphore);
        how many. 0 where the platform cannot (then nothing is consumed)."""
        if not self._enter():
            return 0
        try:
            self._raw_handle()
            n = 0
            while self._raw and not self._closed and _libc().sem_trywait(self._raw) == 0:
                n += 1
            return n
        finally:
            self._leave()

    def pending(self) -> int | None:
        """Posts not yet consumed (sem_getvalue; the GIL is kept), or None where
        the platform cannot say (macOS). 0 once closed."""
        if self._closed:
            return 0
        return self._sem.value if posix_ipc.SEMAPHORE_VALUE_SUPPORTED else None

    def wait(self, timeout_s: float | None) -> bool:
        """Sleep until posted or the timeout passes (None: no timeout). True if
        posted; False at the timeout, and at once when the semaphore is closed
        (also by a signal handler that interrupted this wait). A signal's
        handler runs as the sleep on the main thread is interrupted: what it
        raises ends the wait and propagates; if it returns, the sleep resumes
        with the time left."""
        if not self._enter():
            return False
        try:
            if timeout_s is not None and timeout_s == float("inf"):
                timeout_s = None
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            raw, libc = self._raw_handle(), _sleeper()
            while not self._closed:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                # The blocking calls stay in this frame, each on a line of its
                # own: the GIL tracer (hicache_mp.bench.giltrace) finds a
                # wait's sleep by the frame and line that ran last before it.
                if not raw or libc is None:
                    got = self._acquire(left)
                elif left is None:
                    got = _outcome(libc.sem_wait(raw))
                elif left > 0:
                    until = _deadline(left)
                    got = _outcome(libc.sem_timedwait(raw, until))
                else:
                    got = _outcome(_libc().sem_trywait(raw))  # never blocks: the GIL kept
                if got is not None:
                    return got
                # EINTR: the handler ran and returned (on another thread than
                # the main one, it runs there): sleep what is left.
            return False
        finally:
            self._leave()

    def drain(self) -> None:
        """Consume pending posts, so a burst of batches costs one wake-up.
        libc's sem_trywait, the GIL kept: it never blocks."""
        if not self._enter():
            return
        try:
            raw = self._raw_handle()
            while not self._closed:
                got = _outcome(_libc().sem_trywait(raw)) if raw else self._acquire(0)
                if got is False:
                    return
        finally:
            self._leave()

    def _acquire(self, left: float | None) -> bool | None:
        """posix_ipc's acquire, where libc cannot serve (no handle, no
        sem_timedwait): True taken, False busy, None interrupted. Called
        between _enter and _leave."""
        try:
            self._sem.acquire(left)
            return True
        except posix_ipc.BusyError:
            return False
        except posix_ipc.SignalError:
            return None  # the handler ran inside acquire(); what it raised is lost there

    def close(self) -> None:
        """Unlink the name (if ours) now; the handles once no call is inside
        them, after one post per such call so that none sleeps on."""
        with self._guard:
            if self._closed:
                return
            self._closed = True
            if self.owner:
                try:
                    self._sem.unlink()
                except posix_ipc.ExistentialError:
                    pass
                self.owner = False
            for _ in range(self._inside):
                try:
                    self._sem.release()
                except posix_ipc.Error:
                    break
            if not self._inside:
                self._close_handles()

    def _enter(self) -> bool:
        with self._guard:
            if self._closed:
                return False
            self._inside += 1
            return True

    def _leave(self) -> None:
        with self._guard:
            self._inside -= 1
            if self._closed and not self._inside:
                self._close_handles()

    def _close_handles(self) -> None:
        if not self._handles_open:
            return
        self._handles_open = False
        if self._raw:
            _libc().sem_close(self._raw)
        self._raw = None
        try:
            self._sem.close()
        except posix_ipc.ExistentialError:
            pass
