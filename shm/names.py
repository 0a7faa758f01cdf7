"""Names of shared-memory objects, whether their owner lives, and clean-up of stale ones.

Owns the naming rule (docs/design.md, Parts): every segment and semaphore name is
``hicache_mp.<owner pid>.<random>.<role>``; ``hicache_mp.<owner pid>.<random>``
is the owner tag. Owns the liveness rule (decision 90): an owner is alive while
some process holds the flock of its lock file, ``<tag>.lock`` in /dev/shm
(shm.owner makes and holds it). The kernel drops a flock with the last
process that holds it, so the rule holds across PID namespaces and pid reuse
(a restarted container's engine is pid 1 again, and kill(pid, 0) would call
the dead one alive). An owner without a lock file (an engine of an older
version, the in-process benchmarks) is judged by kill(pid, 0), as before.
Must not create or map anything.
"""
import errno
import fcntl
import logging
import os
import secrets

import posix_ipc

PREFIX = "hicache_mp."
SHM_DIR = "/dev/shm"  # where Linux keeps POSIX segments and (glibc) named semaphores
# glibc stores named semaphores in /dev/shm as "sem.<name>".
SEM_FILE_PREFIX = "sem."
LOCK_SUFFIX = ".lock"  # an owner's lock file: <tag>.lock

log = logging.getLogger("hicache_mp")


def new_owner_tag(pid: int | None = None) -> str:
    """A tag unique to one engine: the owner's pid plus 32 random bits."""
    return f"{PREFIX}{pid or os.getpid()}.{secrets.token_hex(4)}"


def owner_pid(name: str) -> int | None:
    """The pid encoded in one of our names, or None if it is not ours."""
    if name.startswith(SEM_FILE_PREFIX):
        name = name[len(SEM_FILE_PREFIX):]
    if not name.startswith(PREFIX):
        return None
    pid = name[len(PREFIX):].split(".", 1)[0]
    return int(pid) if pid.isdigit() else None


def owner_tag(name: str) -> str | None:
    """The owner tag of one of our names (``hicache_mp.<pid>.<random>``), or None."""
    if name.startswith(SEM_FILE_PREFIX):
        name = name[len(SEM_FILE_PREFIX):]
    if owner_pid(name) is None:
        return None
    return ".".join(name.split(".", 3)[:3])


def lock_name(tag: str) -> str:
    return tag + LOCK_SUFFIX


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM
    return True


def list_ours(shm_dir: str = SHM_DIR) -> list[str]:
    """Entries of /dev/shm that carry our prefix (segments and semaphores)."""
    try:
        entries = os.listdir(shm_dir)
    except FileNotFoundError:
        return []
    return sorted(e for e in entries if owner_pid(e) is not None)


_skipped: set = set()  # names left alone, each logged once


def _unlink(entry: str) -> bool:
    """Unlink one /dev/shm entry of ours (a segment, "sem.<name>", or a lock
    file); True if it was there and went. One we may not remove (another
    user's: EACCES, or EPERM under /dev/shm's sticky bit, which posix_ipc
    raises as its PermissionsError, no PermissionError) is left alone and
    logged once: clean-up never raises."""
    try:
        if entry.startswith(SEM_FILE_PREFIX):
            posix_ipc.unlink_semaphore("/" + entry[len(SEM_FILE_PREFIX):])
        else:
            posix_ipc.unlink_shared_memory("/" + entry)
        return True
    except posix_ipc.ExistentialError:
        return False
    except (posix_ipc.Error, OSError) as exc:
        if entry not in _skipped:
            _skipped.add(entry)
            log.info("hicache_mp: %s/%s is another user's and stays (%s)", SHM_DIR, entry, exc)
        return False


def _take_lock(tag: str, shm_dir: str):
    """The owner's state by its lock file: ("alive", None) while a process
    holds its flock (or we may not open it: another user's, whose entries we
    could not remove anyway); ("dead", fd) with the lock now ours, held while
    its entries are removed; ("no lock", None) where it has none."""
    try:
        fd = os.open(os.path.join(shm_dir, lock_name(tag)), os.O_RDONLY)
    except FileNotFoundError:
        return "no lock", None
    except OSError:
        return "alive", None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return "alive", None
    return "dead", fd


def clean_owner(tag: str, entries, shm_dir: str = SHM_DIR) -> list[str]:
    """Remove `entries` (all of them of owner `tag`) and its lock file if the
    owner is dead (module docstring); the names removed."""
    state, fd = _take_lock(tag, shm_dir)
    if state == "alive" or (state == "no lock" and pid_alive(owner_pid(tag))):
        return []
    try:
        removed = [e for e in entries if not e.endswith(LOCK_SUFFIX) and _unlink(e)]
        # The lock file goes last, still held: while it is there, nobody takes
        # this owner's entries for an old-format owner's.
        if fd is not None and _unlink(lock_name(tag)):
            removed.append(lock_name(tag))
        return removed
    finally:
        if fd is not None:
            os.close(fd)


def unlink_names(segments, semaphores) -> None:
    """Unlink named segments and semaphores, ignoring ones already gone or
    another user's; then the owners' other entries and lock files, if no
    process holds their locks (clean_owner).

    An orphaned worker or evictor calls this for the names it knows, so a
    crashed scheduler leaves nothing in /dev/shm. It never holds its
    engine's lock (the engine's descriptor is close-on-exec), so once the
    engine is dead the lock is free."""
    for name in segments:
        _unlink(name)
    for name in semaphores:
        _unlink(SEM_FILE_PREFIX + name)
    tags = {owner_tag(n) for n in (*segments, *semaphores)} - {None}
    if tags:
        mine = {}
        for entry in list_ours():
            mine.setdefault(owner_tag(entry), []).append(entry)
        for tag in tags:
            clean_owner(tag, mine.get(tag, []))


def clean_stale(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink every segment, semaphore and lock file of a dead owner (module
    docstring); another user's that we may not remove stay.

    Runs at every engine start, so a crashed scheduler's leftovers go away the
    next time anything starts. Returns the names removed.
    """
    by_owner: dict = {}
    for entry in list_ours(shm_dir):
        by_owner.setdefault(owner_tag(entry), []).append(entry)
    removed = []
    for tag, entries in by_owner.items():
        if tag is not None:
            removed += clean_owner(tag, entries, shm_dir)
    return removed
