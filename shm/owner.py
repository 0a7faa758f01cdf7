"""An owner's lock file: what says, to every other process, that an engine is alive.

Owns making, holding and removing ``/dev/shm/<owner tag>.lock`` (mode 0600),
flock'ed (LOCK_EX) from before the owner's first segment until after its
last one is unlinked. The kernel drops the flock when the last descriptor of
it closes, also at a SIGKILL and whatever the PID namespace, so
shm.names.clean_stale removes the segments of an owner whose lock it can take
(decision 90). Must not create or map segments, nor judge other owners
(shm.names does).

Who holds the lock: the descriptor is close-on-exec and the engine's
children start with Popen(close_fds=True), so no worker or evictor holds it.
That is intended: once the engine is dead its orphaned workers unlink what
they know and exit, and nothing the next engine removes is still needed by
a live engine. A child forked without exec from the engine's process shares
the open file and so the lock: the owner then counts as alive while that
child lives, which keeps the segments longer, never removes a live one's.
"""
import fcntl
import os

from .names import SHM_DIR, lock_name

LOCK_MODE = 0o600


class OwnerLock:
    """The flock'ed lock file of owner `tag`; close() unlinks it and lets go."""

    def __init__(self, tag: str, shm_dir: str = SHM_DIR):
        self.tag = tag
        self.path = os.path.join(shm_dir, lock_name(tag))
        self._fd = -1
        while True:
            fd = os.open(self.path, os.O_CREAT | os.O_RDWR, LOCK_MODE)
            try:
                os.fchmod(fd, LOCK_MODE)  # the umask applied to O_CREAT's mode
                fcntl.flock(fd, fcntl.LOCK_EX)
                # A cleaner that opened the file between our open and our flock
                # took it for a dead owner's and removed it: then ours is an
                # unlinked inode nobody can see. Make it again.
                if same_file(fd, self.path):
                    self._fd = fd
                    return
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def close(self) -> None:
        """Unlink the file while still holding it, then let go (idempotent)."""
        if self._fd < 0:
            return
        fd, self._fd = self._fd, -1
        unlink_and_release(fd, self.path)


def unlink_and_release(fd: int, path: str) -> None:
    """Remove a flock'ed file while still holding it, then close it (the lock
    goes with the descriptor): no other process can take the lock of a file
    that is still to be removed. A file gone already, or one this user may not
    remove, is no error."""
    try:
        os.unlink(path)
    except OSError:
        pass
    finally:
        os.close(fd)


def same_file(fd: int, path: str) -> bool:
    """True while `path` names the file open at `fd` (not removed, nor made anew)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    here = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino)
