"""What identifies a model's weights in the key namespace (decisions 91, 106).

Owns one rule for every adapter: two servers share pages only when they
serve the same weights, whatever path or name they give them. A framework's
model name is often a path that many models share (`--model-path /model` in
containers), so the namespace also holds:

- for a local directory: a hash of its config.json and a fingerprint of its
  weight files (each *.safetensors, *.bin, *.pt, *.pth, *.gguf);
- for a local weight file: the same fingerprint of that file;
- for a hub id (no such path here): the id and its revision;
- the served model name and weight version where the framework sets them.

A weight file's fingerprint (decision 106) is its name below the model
directory, its size, the whole JSON header of a .safetensors file (tensor
names, dtypes, shapes, offsets), and its content sampled: a file of at most
STRIDE (1 MiB) whole, a larger one in SAMPLE (4 KiB) reads at every multiple
of STRIDE and its last SAMPLE bytes. What it guarantees: two files that
differ in their size, in their safetensors header, anywhere in a file of at
most STRIDE, or in every byte of a run of STRIDE or more contiguous bytes get
different fingerprints, deterministically (such a run holds a multiple of
STRIDE, whose sample then reads changed bytes); a run whose SAMPLE bytes at
that point happen to be unchanged, or a change narrower than STRIDE that
falls between the samples, can go unseen. Never in it: the path of the model
directory, mtime, inode, owner, so the same weights copied or rewritten
elsewhere share pages. RULE (the rule's version) is hashed in: a change of
the rule is a change of every namespace it makes (a one-time re-warm).

An explicit namespace (the `namespace` key of the extra config) replaces all
of it, and nothing is read: the operator then says which servers share
pages. Must not open anything but the model's config and weight files, nor
read more of a weight file larger than STRIDE than its safetensors header
and SAMPLE bytes per STRIDE (0.4%). A file's fingerprint is remembered in
this process by (device, inode, size, mtime, ctime), only once its mtime and
ctime are RECENT_S in the past (as git's racily clean entries: a write within
the clock's tick could keep both); `forget()` empties it.
"""
import hashlib
import os
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

SAMPLE = 4 << 10       # bytes read at each sample point: a page, the unit the disk reads anyway
STRIDE = 1 << 20       # a sample point every STRIDE bytes: a changed run this long is seen
READERS = 8            # threads reading one file's samples at once (a cold disk's depth)
GROUP = 256            # samples one thread reads and hashes at a time (1 MiB)
HEADER_MAX = 100 << 20  # a safetensors header larger than this is not one (the format's cap)
RECENT_S = 2.0         # a file changed this recently is not remembered
RULE = b"hicache_mp weights v2\0"   # the rule's version: another rule, another namespace
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CONFIG_NAME = "config.json"

_memo: dict = {}       # (dev, ino, size, mtime_ns, ctime_ns) -> a file's digest
_memo_lock = threading.Lock()


def quote(part: str) -> str:
    """`part` with '%' and '|' escaped: fields joined by '|' stay apart, so the
    joined string names one tuple of fields (an injective encoding)."""
    return part.replace("%", "%25").replace("|", "%7C")


def sample_offsets(size: int) -> list:
    """Where a file of more than STRIDE bytes is read, SAMPLE bytes from each:
    every multiple of STRIDE below `size` (moved back to size - SAMPLE where
    it is closer to the end than SAMPLE, so that its read still holds it), and
    size - SAMPLE. A file of at most STRIDE bytes is read whole instead."""
    return [min(at, size - SAMPLE) for at in range(0, size, STRIDE)] + [size - SAMPLE]


def _pread(fd: int, n: int, at: int) -> bytes:
    """`n` bytes at `at`, fewer only at the end of the file."""
    buf = bytearray(n)
    return bytes(buf[:_read_into(fd, memoryview(buf), at)])


def _read_into(fd: int, view: memoryview, at: int) -> int:
    """Fill `view` from offset `at`; the bytes read, fewer only at the end of
    the file (a short read is read on: FUSE may answer a part)."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], at + done)
        if got <= 0:
            break
        done += got
    return done


def _safetensors_header(fd: int, size: int) -> bytes:
    """A .safetensors file's JSON header (its first 8 bytes say how long), or
    b"" where the file is not one."""
    head = _pread(fd, 8, 0)
    if len(head) < 8:
        return b""
    n = struct.unpack("<Q", head)[0]
    if n > HEADER_MAX or 8 + n > size:
        return b""
    return _pread(fd, n, 8)


def _file_digest(path: str, st: os.stat_result, readers: int) -> bytes:
    """sha256 of a weight file's safetensors header (if one) and its samples
    (sample_offsets), in file order."""
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = st.st_size
        if size > STRIDE:
            # Only the pages asked for: the default readahead (often MiBs) would
            # turn each 4 KiB sample of a cold file into a read of the whole file.
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            except (AttributeError, OSError):
                pass
        if path.endswith(".safetensors"):
            header = _safetensors_header(fd, size)
            h.update(b"header\0%d\0" % len(header))
            h.update(header)
        if size <= STRIDE:
            h.update(_pread(fd, size, 0))
        else:
            _hash_samples(h, fd, sample_offsets(size), readers)
    finally:
        os.close(fd)
    return h.digest()


def _group_digest(fd: int, offsets: list) -> bytes:
    """sha256 of SAMPLE bytes at each of `offsets`, in order. A file cut short
    meanwhile reads as zeros past its end."""
    view = memoryview(bytearray(len(offsets) * SAMPLE))
    for k, at in enumerate(offsets):
        part = view[k * SAMPLE:(k + 1) * SAMPLE]
        got = _read_into(fd, part, at)
        if got < SAMPLE:
            part[got:] = bytes(SAMPLE - got)
    return hashlib.sha256(view).digest()


def _hash_samples(h, fd: int, offsets: list, readers: int) -> None:
    """The samples at `offsets` into `h`: GROUP samples at a time are read and
    hashed (sha256) by one of `readers` threads, and the groups' digests go
    into `h` in file order, so the result is the same whatever `readers` is.
    A cold disk sees `readers` reads at once; a warm one hashes on `readers`
    cores (hashlib lets the GIL go)."""
    groups = [offsets[i:i + GROUP] for i in range(0, len(offsets), GROUP)]
    if readers <= 1 or len(groups) == 1:
        for g in groups:
            h.update(_group_digest(fd, g))
        return
    with ThreadPoolExecutor(min(readers, len(groups)),
                            thread_name_prefix="hicache_mp-identity") as pool:
        for digest in pool.map(lambda g: _group_digest(fd, g), groups):
            h.update(digest)


def file_fingerprint(path: str, *, readers: int = READERS) -> bytes:
    """A weight file's digest (header and samples, not its name or size),
    remembered in this process while the file's stat says it is unchanged."""
    st = os.stat(path)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    got = _memo.get(key)
    if got is not None:
        return got
    got = _file_digest(path, st, readers)
    settled = time.time_ns() - int(RECENT_S * 1e9)
    if st.st_mtime_ns < settled and st.st_ctime_ns < settled:
        with _memo_lock:
            if len(_memo) >= 4096:
                _memo.clear()
            _memo[key] = got
    return got


def forget() -> None:
    """Forget every fingerprint remembered in this process (a bench that
    times the reads, a test)."""
    with _memo_lock:
        _memo.clear()


def weights_fingerprint(path: str, *, readers: int = READERS) -> str:
    """Hex digest of a model directory's config and weight files (or of one
    weight file): names below the directory, sizes, the whole config.json,
    and each weight file's fingerprint (file_fingerprint). `readers`: threads
    reading one file's samples at once."""
    h = hashlib.sha256(RULE)
    if os.path.isfile(path):
        files = [path]
        root = os.path.dirname(path)
    else:
        root = path
        files = []
        for d, dirs, names in os.walk(path):
            dirs.sort()
            files += [os.path.join(d, n) for n in sorted(names)
                      if n.endswith(WEIGHT_SUFFIXES) or (d == path and n == CONFIG_NAME)]
    for f in files:
        size = os.path.getsize(f)
        h.update(f"{os.path.relpath(f, root)}\0{size}\0".encode())
        if os.path.basename(f) == CONFIG_NAME:
            with open(f, "rb") as c:   # the whole config: small, and what it says matters
                h.update(hashlib.sha256(c.read()).digest())
        else:
            h.update(file_fingerprint(f, readers=readers))
    return h.hexdigest()


def model_identity(model: str | None, *, revision: str | None = None,
                   served_name: str | None = None, weight_version: str | None = None,
                   namespace: str | None = None) -> str:
    """The identity string for the key namespace (fields quoted and joined by '|')."""
    if namespace:
        return "ns=" + quote(str(namespace))
    parts = []
    if model and os.path.exists(model):
        parts.append("weights=" + weights_fingerprint(model)[:32])
    elif model:
        parts.append("hub=" + quote(model) + "@" + quote(revision or ""))
    if served_name:
        parts.append("served=" + quote(str(served_name)))
    if weight_version:
        parts.append("wv=" + quote(str(weight_version)))
    return "|".join(parts)
