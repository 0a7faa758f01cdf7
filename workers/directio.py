"""O_DIRECT for page files: the probe, the alignment rule and aligned scratch buffers.

Owns the answer to "may this engine's workers open page files with O_DIRECT?"
and the page-aligned buffers those reads and writes need. Must not open page
files itself or know about rings: `workers.worker` does the I/O.

Why O_DIRECT: a store larger than RAM is read cold from NVMe or a network
filesystem. Buffered I/O then costs one extra copy per page (device -> page
cache -> host pool) on a core that one worker already saturates, and it
fills the page cache with pages that the host pool already holds. With O_DIRECT the device DMAs straight into the pool
slot.

The rule (Linux, every filesystem that accepts O_DIRECT): each iovec's address
and length, and the file offset, are multiples of the logical block size. We
use 4096, which covers 512-byte and 4 KiB devices:
  - the page file header is 4096 bytes, so the payload starts aligned;
  - the host pool is an mmap (page-aligned), so a slot run is aligned when its
    offset and length are multiples of 4096 (`geometry_aligned`); when the
    geometry makes any run unaligned the engine uses buffered I/O and says so
    once;
  - header and the "longer than a page" guard use page-aligned scratch
    buffers from an anonymous mmap (`Scratch`).
Whether a filesystem accepts O_DIRECT at all is only known by trying: tmpfs
before Linux 6.6, ramfs, some overlayfs and FUSE mounts refuse it with EINVAL
(at open or at the first read or write), so `probe` opens, writes and reads
back one aligned block of a temp file in the store directory.
"""
import errno
import mmap
import os
import secrets

from workers import naming

ALIGN = 4096
MODES = ("auto", "on", "off")
O_DIRECT = getattr(os, "O_DIRECT", 0)
# errno values with which a filesystem says "no O_DIRECT here".
_REFUSALS = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)
PROBE_MARK = ".directio-probe."


class Scratch:
    """`nbytes` of page-aligned, zeroed memory (an anonymous mapping)."""

    def __init__(self, nbytes: int):
        self.map = mmap.mmap(-1, _round_up(nbytes))
        self.view = memoryview(self.map)

    def __getitem__(self, item):
        return self.view[item]

    def __setitem__(self, item, value):
        self.view[item] = value

    def close(self) -> None:
        self.view.release()
        self.map.close()


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def aligned(n: int) -> bool:
    return n % ALIGN == 0


def geometry_aligned(geometry, num_pages: int, page_runs=None) -> bool:
    """True if every page's runs in the pool start and end on 4096-byte bounds.

    The pool mapping itself starts page-aligned (mmap, or an fd mapped at
    offset 0), so the runs' offsets and lengths are all that matter. Aligned
    runs also make the whole file (4096 + payload) a multiple of 4096, which
    O_DIRECT writes need: no ftruncate fix-up is ever required.
    `page_runs(page)`: the runs where the pool is not the geometry's layout
    (several regions, shm.partpool: offsets within each region).
    """
    if not aligned(geometry.page_bytes):
        return False
    runs = page_runs or (lambda page: geometry.page_runs(page, num_pages))
    # Runs repeat with the page index at a fixed stride; pages 0 and 1 show every case.
    for page in range(min(2, num_pages)):
        for off, length in runs(page):
            if not (aligned(off) and aligned(length)):
                return False
    return True


def probe(directory: str) -> tuple[bool, str]:
    """(accepted, reason): does `directory`'s filesystem do O_DIRECT reads and writes?

    Creates, writes, reads back and unlinks one 4096-byte temp file named
    ``.directio-probe.<pid>.<random>`` (never a page name; the index never
    looks at the store's top level files). A refusal (EINVAL/EOPNOTSUPP) is
    `False, "refused ..."`; any other error (read-only, full, no permission)
    means the question could not be asked: `False, "could not probe ..."`.
    """
    if not O_DIRECT:
        return False, "this platform has no O_DIRECT"
    path = os.path.join(directory, f"{PROBE_MARK}{os.getpid()}.{secrets.token_hex(4)}")
    buf = Scratch(ALIGN)
    fd = -1
    step = "open"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | O_DIRECT, 0o600)
        buf[:8] = b"HICMPDIO"
        step = "write"
        if os.pwritev(fd, [buf.view], 0) != ALIGN:
            return False, "refused (short O_DIRECT write)"
        buf[:8] = b"\0" * 8
        step = "read"
        if os.preadv(fd, [buf.view], 0) != ALIGN or bytes(buf[:8]) != b"HICMPDIO":
            return False, "refused (O_DIRECT read did not return what was written)"
        return True, "accepted"
    except OSError as exc:
        if exc.errno in _REFUSALS:
            return False, f"refused at {step} ({os.strerror(exc.errno)})"
        return False, f"could not probe at {step} ({os.strerror(exc.errno or 0)})"
    finally:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
        buf.close()


def ram_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


def probe_read(directory: str, why: str) -> tuple[bool | None, str]:
    """When no probe file can be written (a full or read-only store): open one
    page file already there O_DIRECT and read its first block.

    (True, reason) if that worked, (False, reason) if the filesystem refused,
    (None, reason) if there is no page to try (nothing to read either).
    """
    for sub in naming.fanout_dirs(directory):
        try:
            with os.scandir(sub) as it:
                name = next((e.path for e in it if e.name.endswith(naming.PAGE_SUFFIX)
                             and e.is_file(follow_symlinks=False)), None)
        except OSError:
            continue
        if name is None:
            continue
        buf = Scratch(ALIGN)
        fd = -1
        try:
            # O_NONBLOCK: a FIFO put there since the scan must not hold the start
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | O_DIRECT)
            os.preadv(fd, [buf.view], 0)
            return True, f"accepted for reads (no write probe: {why})"
        except OSError as exc:
            if exc.errno in _REFUSALS:
                return False, f"refused at read ({os.strerror(exc.errno)})"
            continue
        finally:
            if fd >= 0:
                os.close(fd)
            buf.close()
    return None, f"not probed ({why}; no page to read)"


def resolve(mode: str, directories, geometry, num_pages: int,
            max_bytes: int = 0, page_runs=None) -> tuple[bool, str]:
    """(use O_DIRECT?, one line saying why) for an engine starting on `directories`
    (one path, or the list a striped store spreads over: each must accept).

    "off": never. "on": when the filesystem accepts it and the geometry is
    aligned; anything else is an error (ValueError) at start. "auto": the
    same conditions, and also only when the operator said the store outgrows
    RAM: its `max_bytes` limit is larger than physical memory. A filesystem
    larger than RAM is not enough (almost every disk is): the pages a server
    re-reads are its hot prefixes, which the page cache keeps. Measured on the
    H200 box (decision 18): with "auto" once taking the filesystem's
    252 GB as the store's size, the 20-request long-context run read every
    prefetch cold at 1.5 GB/s, mean TTFT 14.6 s, against 2.6 s buffered; and
    cold, O_DIRECT read no faster there (1.32 GB/s raw, against 1.90 GB/s
    buffered). A store that really outgrows RAM is read mostly cold, where
    O_DIRECT saves a copy per page and keeps the page cache for the rest of
    the machine.

    A store where no probe file can be written (full, read-only) is probed by
    reading a page already there; with none, "on" uses O_DIRECT as asked and
    "auto" does not. Either way the engine starts and serves reads; a write
    then ends with its own status (nospace, denied).
    """
    if mode not in MODES:
        raise ValueError(f"direct_io must be one of {MODES}, got {mode!r}")
    if mode == "off":
        return False, "direct_io=off"
    if not geometry_aligned(geometry, num_pages, page_runs):
        why = (f"page runs of this geometry/layout ({geometry.layout}, {geometry.page_bytes} "
               f"bytes per page) are not multiples of {ALIGN} bytes at {ALIGN}-aligned offsets")
        if mode == "on":
            raise ValueError(f"direct_io=on, but {why}")
        return False, f"buffered I/O: {why}"
    dirs = [directories] if isinstance(directories, str) else list(directories)
    notes = []
    for directory in dirs:
        ok, reason = probe(directory)
        if not ok and reason.startswith("could not probe"):
            ok, reason = probe_read(directory, reason)
            if ok is None:
                ok = mode == "on"
            if ok:
                notes.append(f" ({directory}: {reason})")
        if not ok:
            if mode == "on":
                raise ValueError(f"direct_io=on, but O_DIRECT on {directory}: {reason}")
            return False, f"buffered I/O: O_DIRECT on {directory} {reason}"
    if mode == "auto":
        ram = ram_bytes()
        if not max_bytes:
            return False, ("buffered I/O: no --storage-max-bytes larger than RAM says the store "
                           "outgrows the page cache, which serves hot pages; "
                           "direct_io=on forces O_DIRECT")
        if ram and max_bytes <= ram:
            return False, (f"buffered I/O: the store ({max_bytes / 2**30:.0f} GiB at most) fits in "
                           f"RAM ({ram / 2**30:.0f} GiB), so the page cache serves hot pages; "
                           f"direct_io=on forces O_DIRECT")
    return True, f"O_DIRECT on {', '.join(dirs)}{''.join(notes)}"
