"""Wake-ups: a named POSIX semaphore that idle workers sleep on.

Owns the sleep/post protocol. The scheduler posts once per batch, never once
per page; a sleeper wakes on a post or after a timeout (so it can check on its
parent). posix_ipc releases the GIL while it waits, so a thread blocked here
never starves the scheduler. Must not carry data: the rings do that.
"""
import posix_ipc


class WakeSemaphore:
    def __init__(self, name: str, *, create: bool, mode: int = 0o600):
        self.name = name
        self.owner = create
        if create:
            self._sem = posix_ipc.Semaphore("/" + name, posix_ipc.O_CREX, mode=mode, initial_value=0)
        else:
            self._sem = posix_ipc.Semaphore("/" + name)

    def post(self) -> None:
        self._sem.release()

    def wait(self, timeout_s: float | None) -> bool:
        """Sleep until posted or the timeout passes. True if posted."""
        try:
            self._sem.acquire(timeout_s)
            return True
        except posix_ipc.BusyError:
            return False

    def drain(self) -> None:
        """Consume pending posts, so a burst of batches costs one wake-up."""
        try:
            while True:
                self._sem.acquire(0)
        except posix_ipc.BusyError:
            pass

    def close(self) -> None:
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
