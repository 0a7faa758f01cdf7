"""Making a page file's fan-out directories owner-only, by path (the in-process baselines' way).

`os.makedirs(mode=...)` applies the mode to the last level only, so each
level is made explicitly. Must not touch page files; the `mp` engine's
workers make theirs through workers.filestore, relative to directory fds.
"""
import os

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
