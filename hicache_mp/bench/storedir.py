"""Writing a page file by path, the in-process baselines' way: its fan-out
directories (owner-only), a temp file, the rename over the page's name.

`os.makedirs(mode=...)` applies the mode to the last level only, so each
level is made explicitly. Must not decide a page file's bytes or how they
are written (each baseline's `write` does, as the backend it stands for);
the `mp` engine's workers write theirs through workers.filestore, relative
to directory fds.
"""
import os
from typing import Callable

from workers import status
from workers.store import DIR_MODE


def ensure_parent(path: str, root: str, mode: int = DIR_MODE) -> None:
    """Create the directories between `root` and `path`'s parent, each with `mode`."""
    parent = os.path.dirname(path)
    missing = []
    while parent != root and len(parent) > len(root) and not os.path.isdir(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            pass


def ensure_fanout(page_path: str, mode: int = DIR_MODE) -> None:
    """Create a page file's two fan-out levels (its store root is three levels up)."""
    ensure_parent(page_path, os.path.dirname(os.path.dirname(os.path.dirname(page_path))), mode)


def write_page_file(path: str, tmp: str, write: Callable[[str], None]) -> tuple[int, int]:
    """Make `path`'s fan-out, let `write(tmp)` write the whole file at `tmp`, rename
    it over `path`: (status.OK, 0), or (status.IOERROR, errno) with `tmp` removed."""
    try:
        ensure_fanout(path)
        write(tmp)
        os.replace(tmp, path)
        return status.OK, 0
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return status.IOERROR, exc.errno or 0
