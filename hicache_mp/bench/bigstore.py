"""Large stores, built cheaply: many tiny page files written straight in the page-file format.

Owns building a store of N pages for a start-up bench or test
(scripts/bench_startup.py, tests/storage/test_startup_scan.py) and the
bytes each of its pages holds, so a reader can check them. Must not go
through an engine (that would cost N backups, minutes at a million pages)
nor be used on a store an engine is writing: files are written in place,
not temp + rename.

A page's file is what a worker writes: the 4096-byte header
(workers.pagefile) with the key's digest under the engine's namespace, then
the payload, here a page's worth of one 8-byte word, the page's number, so
any page read back names itself. A million 512-byte pages are 4.6 GB of
files; on local disk a build takes about a minute of one core.
"""
import os
import struct

from shm import PageGeometry
from workers import naming, pagefile


def store_namespace(config, geometry: PageGeometry) -> str:
    """The namespace an engine with `config` files its pages under (the rule is
    workers.naming.namespace's; EngineCore applies it to the same fields)."""
    return naming.namespace(config.model_name, geometry.fingerprint(), tp_rank=config.tp_rank,
                            tp_size=config.tp_size, extra=config.namespace_extra)


def page_key(i: int) -> str:
    """The key of page `i` of a built store."""
    return f"bigstore-{i:08d}"


def payload(i: int, page_bytes: int) -> bytes:
    """The bytes page `i` holds: its number as a little-endian u64, repeated."""
    word = struct.pack("<Q", i)
    return (word * (page_bytes // 8 + 1))[:page_bytes]


def file_bytes(geometry: PageGeometry) -> int:
    """Bytes of one page file (header and payload)."""
    return pagefile.HEADER_SIZE + geometry.page_bytes


def build(root: str, geometry: PageGeometry, namespace: str, count: int, start: int = 0) -> int:
    """Write pages `start` .. `start + count - 1` under `root` (made if need
    be); returns the bytes written. A page already there is rewritten."""
    os.makedirs(root, mode=0o700, exist_ok=True)
    fp, plen = geometry.fingerprint(), geometry.page_bytes
    made = set()
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    for i in range(start, start + count):
        digest = naming.key_digest(page_key(i), namespace)
        path = naming.page_path(root, digest)
        leaf = os.path.dirname(path)
        if leaf not in made:
            os.makedirs(leaf, mode=0o700, exist_ok=True)
            made.add(leaf)
        fd = os.open(path, flags, 0o600)
        try:
            os.writev(fd, [pagefile.build_header(plen, fp, digest), payload(i, plen)])
        finally:
            os.close(fd)
    return count * file_bytes(geometry)
