"""The store factory: the stores a `storage_dir` spec can name, one registration line each.

Owns `open_store`, the one place that turns a spec into a store, and the
ordered registrations it reads: the first factory whose `matches(spec)` is
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


def open_store(spec: str, io: StoreIO | None = None) -> PageStore:
    """The store a `storage_dir` spec names, doing I/O as `io` says."""
    io = io or StoreIO()
    for matches, factory in _FACTORIES:
        if matches(spec):
            return factory(spec, io)
    return FileStore(spec, io)


register(lambda spec: "," in spec, StripedStore)  # /nvme0/kv,/nvme1/kv: one directory per drive
