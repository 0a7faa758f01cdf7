"""Key-to-path naming for the page store.

Owns the one rule that turns a caller's key into a file path: the path comes
from sha256(namespace, key), fanned out over two directory levels, so a key is
never used as a path (no traversal) and no directory holds millions of entries;
and where that rule puts page files (`fanout_dirs`, the directories a scan
walks), and the refusal of a key no file can be named after (`KeyRefused`).
Must not open or judge page files.
"""
import hashlib
import os

PAGE_SUFFIX = ".page"
TMP_MARK = ".tmp."  # temp files: workers.tmpfiles
# Where damaged page files go when `quarantine_bad_files` is on. Its name is not
# two characters long, so the index scan never walks into it.
QUARANTINE_DIR = "quarantine"
MAX_KEY_BYTES = 4096
FORBIDDEN_IN_KEYS = ("/", "\\", "\0")


def namespace(model: str, geometry_fingerprint: bytes, *, tp_rank: int = 0, tp_size: int = 1,
              extra: str = "") -> str:
    """The namespace a store's keys live in: model, TP rank/size and geometry.

    Two engines whose namespaces differ can share a directory without ever
    reading each other's pages. The model's '%' and '|' are escaped, so no
    two (model, extra) pairs give one namespace (a model name holding
    "|tp0of1|..." cannot pass for another's extra); a name without them is
    kept as it is, and so are the stores written under it.
    """
    model = model.replace("%", "%25").replace("|", "%7C")
    return f"{model}|tp{tp_rank}of{tp_size}|{geometry_fingerprint.hex()}|{extra}"


class KeyRefused(ValueError):
    """A key the store cannot name a file after (too long, empty, '/', '..',
    NUL, not str/bytes). Its own class so that a framework adapter can answer
    a scheduler's call about such a key as a miss or a failed store, where any
    other ValueError is a bug to surface."""


def check_key(key) -> bytes:
    """Return the key's bytes, or raise KeyRefused for a key we refuse."""
    if isinstance(key, str):
        raw = key.encode()
    elif isinstance(key, (bytes, bytearray)):
        raw = bytes(key)
    else:
        raise KeyRefused(f"a key must be str or bytes, got {type(key).__name__}")
    if not raw:
        raise KeyRefused("empty key")
    if len(raw) > MAX_KEY_BYTES:
        raise KeyRefused(f"key of {len(raw)} bytes is longer than {MAX_KEY_BYTES}")
    # Byte tests, no decode and no generator: this runs on the scheduler's
    # thread for every key it has not asked about before.
    if b".." in raw or b"/" in raw or b"\\" in raw or b"\0" in raw:
        raise KeyRefused(f"key {key!r} contains '/', '\\\\', '..' or NUL")
    return raw


# Digests remembered per process: a scheduler asks about the same keys again
# and again (batch_exists, then batch_get, then every request sharing the
# prefix), and each costs a key check and a sha256 on its thread. Emptied
# when full: a dict clear is cheaper than any eviction order, and a miss only
# costs the computation again.
_DIGESTS: dict = {}
_DIGESTS_MAX = 1 << 15


def key_digest(key, ns: str) -> bytes:
    """32-byte identity of a key within a namespace (checks the key first)."""
    try:
        return _DIGESTS[ns, key]
    except KeyError:
        pass
    except TypeError:  # an unhashable key (bytearray): computed every time
        return _compute_digest(key, ns)
    digest = _compute_digest(key, ns)  # raises for a bad key: never remembered
    if len(_DIGESTS) >= _DIGESTS_MAX:
        _DIGESTS.clear()
    _DIGESTS[ns, key] = digest
    return digest


_NS_HASH: dict = {}  # namespace -> sha256 state after "namespace\0": copied per key


def _compute_digest(key, ns: str) -> bytes:
    raw = check_key(key)
    try:
        h = _NS_HASH[ns].copy()
    except KeyError:
        h = _NS_HASH.setdefault(ns, hashlib.sha256(ns.encode() + b"\0")).copy()
    h.update(raw)
    return h.digest()


def page_path(root: str, digest: bytes) -> str:
    h = digest.hex()
    return os.path.join(root, h[:2], h[2:4], h + PAGE_SUFFIX)


def digest_from_name(filename: str) -> bytes | None:
    """The digest a store file name carries, or None for anything else."""
    if not filename.endswith(PAGE_SUFFIX) or len(filename) != 64 + len(PAGE_SUFFIX):
        return None
    try:
        return bytes.fromhex(filename[:64])
    except ValueError:
        return None


def quarantine_name(name: str, cause: str, pid: int, serial: int) -> str:
    """The name a damaged page file gets in QUARANTINE_DIR: it never ends in
    .page, and a cause, pid and serial keep every moved file apart."""
    return f"{name}.{cause}.{pid}.{serial}"


def fanout_dirs(root: str) -> list[str]:
    """The second-level fan-out directories under `root` (where page files live)."""
    return [sub for top in _two_char_dirs(root) for sub in _two_char_dirs(top)]


def has_fanout(root: str) -> bool:
    """Does `root` hold a fan-out directory (a store nothing was ever written
    to, or one cleared, holds none)? One listing of the root."""
    return bool(_two_char_dirs(root))


def _two_char_dirs(path: str) -> list[str]:
    try:
        with os.scandir(path) as it:
            return [e.path for e in it if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
