"""Store directories: creating the fan-out levels owner-only.

Owns directory creation for the page store. `os.makedirs(mode=...)` applies
the mode to the last level only, so each level is made explicitly. Must not
touch page files.
"""
import os

DIR_MODE = 0o700


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
