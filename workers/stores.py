"""The store factory: the stores a `storage_dir` can name, one registration line each.

Owns `open_store`, the one place that turns a `storage_dir` into a store, and the
ordered registrations it reads: the first factory whose `matches(storage_dir)` is
true builds the store, and a plain directory (workers.filestore.FileStore)
is the fallback. Must hold nothing else: the interface is workers.store,
which every store imports, so the factory that imports the stores lives here,
above them.
"""
from typing import Callable

from workers.filestore import FileStore
from workers.store import PageStore, StoreIO
from workers.stripestore import StripedStore

_FACTORIES: list[tuple[Callable[[str], bool], Callable]] = []


def register(matches: Callable[[str], bool], factory: Callable) -> None:
    _FACTORIES.append((matches, factory))


def open_store(storage_dir: str, io: StoreIO | None = None) -> PageStore:
    """The store a `storage_dir` names, doing I/O as `io` says."""
    io = io or StoreIO()
    for matches, factory in _FACTORIES:
        if matches(storage_dir):
            return factory(storage_dir, io)
    return FileStore(storage_dir, io)


register(lambda storage_dir: "," in storage_dir, StripedStore)  # /nvme0/kv,/nvme1/kv: one directory per drive
