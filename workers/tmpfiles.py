"""Temp-file ownership on a page store that several hosts and containers may share.

Owns the temp-file name (who wrote it) and the one staleness rule (may a
scan remove it?). Must not open page files or walk directories.

A writer writes a page into a private temp file beside its final name and
renames it into place. A writer that dies leaves its temp file behind, so a
scan removes temp files whose writer is gone; the danger is removing a live
writer's file, which fails its backup. A pid identifies a process only within
one pid namespace of one boot of one host, so the name carries all of that:

    <page name>.tmp.<pid>.<owner>.<token>.<serial>
    owner = <host>-<boot id, 8 hex>-<pid namespace inode>

`token` is random per process, so a name is never reused even when a pid is.
Staleness:
  - same owner (this host, this boot, this pid namespace): the writer is gone
    when its pid does not exist or is a zombie (/proc/<pid>/stat state Z or
    X): a crashed writer that its parent has not reaped yet is dead;
  - any other owner, and the older names that carry no owner: only by age,
    `FOREIGN_TMP_STALE_S` since the file last changed. A pid from another
    namespace or host means nothing here and is never looked up.
"""
import os
import re
import secrets
import socket

from workers.naming import TMP_MARK
from workers.timing import FOREIGN_TMP_STALE_S

_ident: tuple[int, str, str] | None = None  # (pid, owner, token), rebuilt after fork


def _read_first_line(path: str) -> str:
    try:
        with open(path) as f:
            return f.readline().strip()
    except OSError:
        return ""


def _identity() -> tuple[str, str]:
    global _ident
    pid = os.getpid()
    if _ident is None or _ident[0] != pid:
        host = re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"
        boot = re.sub(r"[^0-9a-f]", "", _read_first_line("/proc/sys/kernel/random/boot_id"))[:8]
        try:
            ns = os.stat("/proc/self/ns/pid").st_ino
        except OSError:
            ns = 0
        _ident = (pid, f"{host}-{boot or 'noboot'}-{ns}", secrets.token_hex(4))
    return _ident[1], _ident[2]


def owner() -> str:
    """This process's owner field: host, boot id and pid namespace (no dots)."""
    return _identity()[0]


def tmp_name(name: str, serial: int) -> str:
    """The private temp name for writing page file `name` (a basename or a path)."""
    own, token = _identity()
    return f"{name}{TMP_MARK}{os.getpid()}.{own}.{token}.{serial}"


def parse(filename: str) -> tuple[int, str | None] | None:
    """(writer pid, owner or None for the older owner-less names), or None if
    `filename` is not a temp file."""
    i = filename.find(TMP_MARK)
    if i < 0:
        return None
    parts = filename[i + len(TMP_MARK):].split(".")
    if not parts[0].isdigit():
        return None
    return int(parts[0]), (parts[1] if len(parts) == 4 else None)


def is_tmp(filename: str) -> bool:
    return TMP_MARK in filename


def stale(filename: str, mtime: float, now: float) -> bool:
    """May a scan remove this temp file? (The module docstring's rule.)"""
    parsed = parse(filename)
    if parsed is None:
        return False
    pid, own = parsed
    if own is not None and own == owner():
        return not pid_running(pid)
    return now - mtime > FOREIGN_TMP_STALE_S


def pid_running(pid: int) -> bool:
    """True if `pid` is a process of this pid namespace that has not exited (a zombie has)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot tell: keep the file (the safe side)
    state = stat[stat.rfind(b")") + 2:][:1]
    return state not in (b"Z", b"X", b"")
