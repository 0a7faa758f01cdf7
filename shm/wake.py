"""Wake-ups: a named POSIX semaphore that idle workers sleep on.

Owns the sleep/post protocol. The scheduler posts once per batch, never once
per page; a sleeper wakes on a post or after a timeout (so it can check on its
parent). posix_ipc releases the GIL while it waits, so a thread blocked here
never starves the scheduler. A signal that interrupts the sleep (any process
with a Python signal handler, as servers have) resumes it within the same
deadline: a wait ends only on a post or on its timeout. Must not carry data:
the rings do that.

Closing is safe at any point of another call, also from a signal handler
that interrupted a wait on the same thread: a closed semaphore ends every
wait at once (as a timeout), posts nothing and has nothing pending; its name
goes at once, its handles only once no call is inside them (closing a handle
a thread sleeps on, or is about to try, is undefined behaviour in POSIX).
"""
import ctypes
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


class WakeSemaphore:
    def __init__(self, name: str, *, create: bool, mode: int = 0o600):
        self.name = name
        self.owner = create
        self._raw = None  # libc handle for take_pending, opened on first use
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
        (also by a signal handler that interrupted this wait)."""
        if not self._enter():
            return False
        try:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            left = timeout_s
            while not self._closed:
                try:
                    self._sem.acquire(left)
                    return True
                except posix_ipc.BusyError:
                    return False
                except posix_ipc.SignalError:
                    # EINTR: the handler itself runs (and may raise) at the next bytecode
                    if deadline is not None:
                        left = max(0.0, deadline - time.monotonic())
            return False
        finally:
            self._leave()

    def drain(self) -> None:
        """Consume pending posts, so a burst of batches costs one wake-up."""
        if not self._enter():
            return
        try:
            while not self._closed:
                try:
                    self._sem.acquire(0)
                except posix_ipc.BusyError:
                    return
                except posix_ipc.SignalError:
                    continue
        finally:
            self._leave()

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
