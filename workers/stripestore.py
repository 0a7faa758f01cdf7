"""StripedStore: pages spread over several directories (one per drive) by digest.

Owns placement: page -> directory, a pure function of the digest and the
list, so every engine started on the same list finds every page, with no
table to share. Must not do file I/O itself: each directory is a FileStore,
and a call goes to the one that owns the page.

`--storage-dir /nvme0/kv,/nvme1/kv,...` (SGLang: the same string as
`storage_dir`) gives a server with several NVMe drives their summed
bandwidth without RAID. The list and its order are the store's identity:
placement is `digest mod len(list)` over bytes that the fan-out does not
use, so a different list places most pages elsewhere, where they are
misses (a cache loses them; nothing reads wrong bytes). Each directory
fills, fails and is evicted on its own (`parts()`): a drive that fails or
fills ends its own pages as clean misses and failed writes, and the others
go on.
"""
from workers.filestore import FileStore
from workers.store import PageStore, Scan, StoreIO, split_dirs


class StripedStore(PageStore):
    def __init__(self, storage_dir: str, io: StoreIO | None = None):
        self.roots = split_dirs(storage_dir)
        self.stores = [FileStore(root, io) for root in self.roots]

    def part(self, digest: bytes) -> FileStore:
        # The last 8 bytes: the fan-out names directories by the first two.
        return self.stores[int.from_bytes(digest[-8:], "little") % len(self.stores)]

    def read(self, digest, iovecs, bufs, ranges=None):
        return self.part(digest).read(digest, iovecs, bufs, ranges)

    def write(self, digest, iovecs, bufs):
        return self.part(digest).write(digest, iovecs, bufs)

    def remove(self, digest) -> bool:
        return self.part(digest).remove(digest)

    def touch(self, digest) -> None:
        self.part(digest).touch(digest)

    def exists(self, digest) -> bool:
        return self.part(digest).exists(digest)

    def path(self, digest) -> str:
        return self.part(digest).path(digest)

    def scan(self, reap_tmp: bool = False) -> Scan:
        pages, temps, total, reaped = [], [], 0, 0
        for store in self.stores:
            one = store.scan(reap_tmp)
            pages += one.pages
            temps += one.temps
            total += one.total_bytes
            reaped += one.stale_removed
        return Scan(pages, total, reaped, tuple(temps))

    def blank(self) -> bool:
        return all(store.blank() for store in self.stores)

    def walk(self, reap_tmp: bool = False):
        for store in self.stores:
            yield from store.walk(reap_tmp)

    def free_bytes(self, digest: bytes | None = None) -> int | None:
        if digest is not None:
            return self.part(digest).free_bytes()
        known = [f for f in (s.free_bytes() for s in self.stores) if f is not None]
        return min(known) if known else None

    def parts(self) -> list:
        return list(self.stores)
