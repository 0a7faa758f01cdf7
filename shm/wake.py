"""Wake-ups: a named POSIX semaphore that idle workers sleep on.

Owns the sleep/post protocol. The scheduler posts once per batch, never once
per page; a sleeper wakes on a post or after a timeout (so it can check on its
parent). posix_ipc releases the GIL while it waits, so a thread blocked here
never starves the scheduler. A signal that interrupts the sleep (any process
with a Python signal handler, as servers have) resumes it within the same
deadline: a wait ends only on a post or on its timeout. Must not carry data:
the rings do that.
"""
import ctypes
import ctypes.util
import time

import posix_ipc

# libc called with the GIL held (PyDLL): sem_trywait never blocks, and a
# posix_ipc acquire gives the GIL up even for that (module docstring).
_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        lib = ctypes.PyDLL(ctypes.util.find_library("c") or None, use_errno=True)
        lib.sem_open.restype = ctypes.c_void_p
        lib.sem_open.argtypes = [ctypes.c_char_p, ctypes.c_int]
        lib.sem_trywait.argtypes = [ctypes.c_void_p]
        lib.sem_close.argtypes = [ctypes.c_void_p]
        _LIBC = lib
    return _LIBC


_SEM_FAILED = ctypes.c_void_p(-1).value


class WakeSemaphore:
    def __init__(self, name: str, *, create: bool, mode: int = 0o600):
        self.name = name
        self.owner = create
        self._raw = None  # libc handle for take_pending, opened on first use
        if create:
            self._sem = posix_ipc.Semaphore("/" + name, posix_ipc.O_CREX, mode=mode, initial_value=0)
        else:
            self._sem = posix_ipc.Semaphore("/" + name)

    def post(self) -> None:
        self._sem.release()

    def take_pending(self) -> int:
        """Consume every post pending now without giving the GIL up (libc's
        sem_trywait on this process's own handle of the named semaphore);
        how many. 0 where the platform cannot (then nothing is consumed)."""
        if self._raw is None:
            lib = _libc()
            raw = lib.sem_open(("/" + self.name).encode(), 0)
            self._raw = raw if raw not in (None, _SEM_FAILED) else 0
        n = 0
        while self._raw and _libc().sem_trywait(self._raw) == 0:
            n += 1
        return n

    def pending(self) -> int | None:
        """Posts not yet consumed (sem_getvalue; the GIL is kept), or None where
        the platform cannot say (macOS)."""
        return self._sem.value if posix_ipc.SEMAPHORE_VALUE_SUPPORTED else None

    def wait(self, timeout_s: float | None) -> bool:
        """Sleep until posted or the timeout passes (None: no timeout). True if posted."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        left = timeout_s
        while True:
            try:
                self._sem.acquire(left)
                return True
            except posix_ipc.BusyError:
                return False
            except posix_ipc.SignalError:
                # EINTR: the handler itself runs (and may raise) at the next bytecode
                if deadline is not None:
                    left = max(0.0, deadline - time.monotonic())

    def drain(self) -> None:
        """Consume pending posts, so a burst of batches costs one wake-up."""
        while True:
            try:
                self._sem.acquire(0)
            except posix_ipc.BusyError:
                return
            except posix_ipc.SignalError:
                continue

    def close(self) -> None:
        if self._raw:
            _libc().sem_close(self._raw)
        self._raw = None
        if self.owner:
            try:
                self._sem.unlink()
            except posix_ipc.ExistentialError:
                pass
            self.owner = False
        try:
            self._sem.close()
        except posix_ipc.ExistentialError:
            pass
