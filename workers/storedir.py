"""Store directories: creating the fan-out levels owner-only.

Owns the page store's directory tree: creating the fan-out levels and walking
them. `os.makedirs(mode=...)` applies
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


def fanout_dirs(root: str) -> list[str]:
    """The second-level fan-out directories under `root` (where page files live)."""
    return [sub for top in _two_char_dirs(root) for sub in _two_char_dirs(top)]


def _two_char_dirs(path: str) -> list[str]:
    try:
        with os.scandir(path) as it:
            return [e.path for e in it if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
