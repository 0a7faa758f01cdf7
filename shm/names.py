"""Names of shared-memory objects and clean-up of stale ones.

Owns the naming rule (docs/design.md, Parts): every segment and semaphore name is
``hicache_mp.<owner pid>.<random>.<role>``, so a leftover can be traced to its
owner and removed once that owner is dead. Must not create or map anything.
"""
import errno
import os
import secrets

import posix_ipc

PREFIX = "hicache_mp."
SHM_DIR = "/dev/shm"  # where Linux keeps POSIX segments and (glibc) named semaphores
# glibc stores named semaphores in /dev/shm as "sem.<name>".
SEM_FILE_PREFIX = "sem."


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


def unlink_names(segments, semaphores) -> None:
    """Unlink named segments and semaphores, ignoring ones already gone.

    An orphaned worker or evictor calls this for the names it knows, so a
    crashed scheduler leaves nothing in /dev/shm."""
    for name in segments:
        try:
            posix_ipc.unlink_shared_memory("/" + name)
        except (posix_ipc.ExistentialError, PermissionError):
            pass
    for name in semaphores:
        try:
            posix_ipc.unlink_semaphore("/" + name)
        except (posix_ipc.ExistentialError, PermissionError):
            pass


def clean_stale(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink every segment and semaphore whose owner pid is dead.

    Runs at every engine start, so a crashed scheduler's leftovers go away the
    next time anything starts. Returns the names removed.
    """
    removed = []
    for entry in list_ours(shm_dir):
        pid = owner_pid(entry)
        if pid is None or pid_alive(pid):
            continue
        try:
            if entry.startswith(SEM_FILE_PREFIX):
                posix_ipc.unlink_semaphore("/" + entry[len(SEM_FILE_PREFIX):])
            else:
                posix_ipc.unlink_shared_memory("/" + entry)
            removed.append(entry)
        except (posix_ipc.ExistentialError, PermissionError):
            pass
    return removed
