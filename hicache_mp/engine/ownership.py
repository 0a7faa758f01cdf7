"""Process ownership of an engine: it belongs to the process that made it.

Owns the set of this process's live engines, the at-fork hook that makes a
forked child disown them all before it runs any code of its own, and the
refusal (EngineForked) of every call a child makes on one. Must not touch
the parent's workers, rings, segments or files from the child: disowning
only forgets them (its I/O backend's `forget`), and takes no lock
(another parent thread may have held one at the fork).
"""
import os
import weakref

from .closing import EngineForked

# Engines of this process; a forked child disowns them all before it runs any
# code of its own (os.register_at_fork), so nothing it does, or its exit,
# touches the parent's workers, rings, segments or files.
_LIVE = weakref.WeakSet()


def _disown_after_fork() -> None:
    for engine in list(_LIVE):
        engine.disown_after_fork()


os.register_at_fork(after_in_child=_disown_after_fork)


class Ownership:
    """EngineCore's process ownership: `_init_ownership` records the owner,
    `_own` (last in the engine's __init__) puts it under the at-fork hook."""

    def _init_ownership(self) -> None:
        self._owner_pid = os.getpid()
        self._forked = False

    def _own(self) -> None:
        _LIVE.add(self)

    def disown_after_fork(self) -> None:
        """In a forked child: the engine is the parent's. Runs in the at-fork hook,
        so it takes no lock (another parent thread may have held one at the fork)."""
        self._forked = True
        self._io.forget()

    def _refuse_in_child(self):
        raise EngineForked(
            f"this hicache_mp engine belongs to process {self._owner_pid}; process "
            f"{os.getpid()} is a fork of it and cannot use it (its workers, rings and shared "
            f"memory are the parent's). Create a new engine in the child")
