"""A real EIO on a page read: one FUSE directory whose files fail every read.

Owns a minimal FUSE server spoken straight over /dev/fuse (no libfuse or
Python FUSE package is installed here, and device-mapper's `error` target
needs a kernel driver this machine lacks). Mounted over one fan-out leaf
directory of a store, it shows each named file at its real size and answers
READ with EIO, as a failing disk or a network filesystem does; given a
`hold` event, it answers no READ until the event is set, as a hung network
filesystem does (the reader waits in the kernel); given `gone_after_open`,
a file once opened answers GETATTR with ENOENT (attributes never cached), as
a network filesystem (JuiceFS) does for a page replaced since the open, so
an `fstat` of the open file fails; every other
request a page reader makes (lookup, getattr, open, release) is answered,
the rest with ENOSYS. Must only run in a private mount namespace
(`unshare(CLONE_NEWNS)`, done by `mount_eio`), so a dead server leaves no
mount behind on the host. Torch-free: it runs inside `faultkit.run_child`.
"""
import ctypes
import errno
import os
import stat
import struct
import threading

CLONE_NEWNS = 0x00020000
MS_REC, MS_PRIVATE = 0x4000, 1 << 18
MNT_DETACH = 2
_IN_HEADER = struct.Struct("<IIQQIIII")     # len, opcode, unique, nodeid, uid, gid, pid, pad
_OUT_HEADER = struct.Struct("<IiQ")         # len, error, unique
_ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr (88 bytes)
LOOKUP, FORGET, GETATTR, OPEN, READ, RELEASE, FLUSH, INIT, OPENDIR, RELEASEDIR, \
    DESTROY, BATCH_FORGET = 1, 2, 3, 14, 15, 18, 25, 26, 27, 29, 38, 42
_NO_REPLY = (FORGET, BATCH_FORGET)
ROOT_ID = 1
HOLD_S = 60.0


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


class EioDir:
    """Files `sizes` ({name: bytes}) in one directory; each read fails with EIO."""

    def __init__(self, sizes: dict, hold: threading.Event | None = None,
                 gone_after_open: bool = False):
        self.names = list(sizes)
        self.gone_after_open = gone_after_open
        self.opened: set = set()            # nodes opened (gone_after_open)
        self.gone_answers = 0               # GETATTRs answered ENOENT
        self.sizes = dict(sizes)
        self.hold = hold                    # READ waits for it (at most HOLD_S)
        self.reads = 0                      # READ requests received (answered with EIO)
        self.fd = -1
        self.mountpoint = None
        self._thread = None

    def _attr(self, node: int) -> bytes:
        if node == ROOT_ID:
            return _ATTR.pack(ROOT_ID, 0, 0, 0, 0, 0, 0, 0, 0, stat.S_IFDIR | 0o755, 2, 0, 0, 0,
                              4096, 0)
        size = self.sizes[self.names[node - 2]]
        return _ATTR.pack(node, size, (size + 511) // 512, 0, 0, 0, 0, 0, 0,
                          stat.S_IFREG | 0o600, 1, 0, 0, 0, 4096, 0)

    def _answer(self, opcode: int, node: int, body: bytes):
        """(errno, reply body) for one request."""
        if opcode == INIT:
            major, minor = struct.unpack_from("<II", body)
            # fuse_init_out of protocol 7.23+: 64 bytes, every option off
            return 0, struct.pack("<IIIIHHIIHHI7I", 7, min(minor, 31), 0, 0, 16, 12, 1 << 16,
                                  1, 0, 0, 0, *([0] * 7))
        if opcode == LOOKUP:
            name = body.split(b"\0", 1)[0].decode()
            if node != ROOT_ID or name not in self.names:
                return errno.ENOENT, b""
            child = self.names.index(name) + 2
            ttl = 0 if self.gone_after_open else 3600  # 0: the kernel asks GETATTR each time
            return 0, struct.pack("<QQQQII", child, 0, 3600, ttl, 0, 0) + self._attr(child)
        if opcode == GETATTR:
            if node in self.opened:
                self.gone_answers += 1
                return errno.ENOENT, b""
            ttl = 0 if self.gone_after_open else 3600
            return 0, struct.pack("<QII", ttl, 0, 0) + self._attr(node)
        if opcode in (OPEN, OPENDIR):
            if opcode == OPEN and self.gone_after_open:
                self.opened.add(node)
            return 0, struct.pack("<QII", 0, 0, 0)
        if opcode == READ:
            self.reads += 1
            if self.hold is not None:
                self.hold.wait(HOLD_S)  # bounded: a test that never sets it still ends
            return errno.EIO, b""
        if opcode in (RELEASE, RELEASEDIR, FLUSH):
            return 0, b""
        return errno.ENOSYS, b""

    def _serve(self) -> None:
        while True:
            try:
                req = os.read(self.fd, 1 << 17)
            except OSError as exc:
                if exc.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                    continue
                return  # ENODEV: unmounted
            _, opcode, unique, node, *_ = _IN_HEADER.unpack_from(req)
            if opcode == DESTROY:
                return
            if opcode in _NO_REPLY:
                continue
            err, out = self._answer(opcode, node, req[_IN_HEADER.size:])
            os.write(self.fd, _OUT_HEADER.pack(_OUT_HEADER.size + len(out), -err, unique) + out)

    def mount(self, mountpoint: str) -> None:
        self.fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        opts = f"fd={self.fd},rootmode=40000,user_id=0,group_id=0,allow_other".encode()
        _check(_libc().mount(b"eiofuse", mountpoint.encode(), b"fuse", 0, opts), "mount fuse")
        self.mountpoint = mountpoint
        # /dev/fuse reads fail (EPERM) until the mount made the connection
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def unmount(self) -> None:
        if self.mountpoint is not None:
            _check(_libc().umount2(self.mountpoint.encode(), MNT_DETACH), "umount")
            self.mountpoint = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def private_mounts() -> None:
    """This process (and what it starts after) in its own mount namespace."""
    libc = _libc()
    _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")


def mount_eio(leaf_dir: str, sizes: dict, hold: threading.Event | None = None,
              gone_after_open: bool = False) -> EioDir:
    """An EioDir of `sizes` mounted over `leaf_dir` (call private_mounts() first)."""
    d = EioDir(sizes, hold, gone_after_open)
    d.mount(leaf_dir)
    return d
