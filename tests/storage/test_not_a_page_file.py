"""Something other than a regular file at a page's path: a miss at once, never a stall.

A FIFO at a page path (left by a tool, or planted) made the worker's open()
wait for a writer that never came: every read of that key sat out the stall
watchdog (`stall_timeout_s`, 30 s), then the worker was killed and replaced.
A device node was read as if it were a page (/dev/zero's bytes judged
`corrupt`, and with quarantine on, the node itself moved aside). Now page
files are opened O_NONBLOCK and anything but a regular file is `unreadable`
(a miss, status counted) before a byte is read.

Real FIFOs and device nodes in a real store, read by real workers, with the
default 30 s stall timeout: the op must end in seconds, its other pages
byte-exact, no worker stuck or replaced; the next backup of that key replaces
the node with a page (by rename) and reads back byte-exact.

The regular-file check's fstat can itself fail on a network filesystem (a
page replaced since its open: ENOENT on FUSE): a miss, never an exception
out of the worker (a real FUSE directory, tests/faults/eiofuse.py).
"""
import os
import stat
import threading
import time

import pytest

from faultkit import MID, backup, content, fingerprint, get, make, page_file, poison, \
    prefetch, wrong_pages
from workers import status as st

KEYS = [f"k-{i}" for i in range(6)]
ODD = 2  # the key whose page file is replaced


def _fifo(path: str) -> None:
    os.mkfifo(path, 0o600)


def _zero_device(path: str) -> None:
    os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # what /dev/zero is


def _release(path: str) -> None:
    """Let an open() blocked on the FIFO return (only the unfixed code blocks):
    a writer arrives and leaves at once; ENXIO when no reader waits."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


@pytest.mark.parametrize("io_depth", [1, 3])
@pytest.mark.parametrize("node", ["fifo", "chardev"])
def test_a_special_file_at_a_page_path_is_unreadable_at_once(store, node, io_depth):
    if node == "chardev" and os.geteuid() != 0:
        pytest.skip("mknod of a character device needs root")
    with make(store, geo=MID, pages=16, workers=1, io_depth=io_depth,
              quarantine_bad_files=True) as e:
        assert e.config.stall_timeout_s == 30  # the watchdog this must not wait for
        pb = e.geometry.page_bytes
        assert backup(e, KEYS, range(6)).status == "ok"
        path = page_file(e, KEYS[ODD])
        os.unlink(path)
        (_fifo if node == "fifo" else _zero_device)(path)
        slots = list(range(8, 14))
        t0 = time.monotonic()
        poison(e, slots)
        op = e.prefetch(KEYS, slots)
        try:
            finished = e.wait(op, 10)
            took = time.monotonic() - t0
        finally:
            if node == "fifo":
                threading.Thread(target=_release, args=(path,), daemon=True).start()
        assert finished and took < 5, (took, op.status_counts())
        statuses = [int(s) for s in op.page_status]
        assert statuses == [st.UNREADABLE if i == ODD else st.OK for i in range(6)], statuses
        assert not wrong_pages(e, op, lambda k: {fingerprint(content(k, pb))})
        assert get(e, slots[ODD]) == b"\xa5" * pb  # not a byte of the node reached the slot
        m = e.metrics()
        assert m["stuck_workers"] == 0 and m["respawns"] == 0, m
        # left where it is for an operator (unreadable is not moved aside) ...
        assert not stat.S_ISREG(os.lstat(path).st_mode)
        # ... until the next backup of the key renames a page over it
        assert backup(e, [KEYS[ODD]], [0], version=1).status == "ok"
        assert stat.S_ISREG(os.lstat(path).st_mode)
        again = prefetch(e, [KEYS[ODD]], [15])
        assert again.status == "ok" and get(e, 15) == content(KEYS[ODD], pb, version=1)


GONE_BODY = """
import os
from faultkit import backup, content, fingerprint, get, make, page_file, prefetch
import eiofuse
keys = ["a", "b", "c", "d"]
eiofuse.private_mounts()     # before the workers start: they share the mount
with make(args[0], pages=8, workers=1) as e:
    pb = e.geometry.page_bytes
    backup(e, keys, range(4))
    path = page_file(e, "d")
    leaf = os.path.dirname(path)
    assert os.listdir(leaf) == [os.path.basename(path)]
    fuse = eiofuse.mount_eio(leaf, {os.path.basename(path): os.stat(path).st_size},
                             gone_after_open=True)
    pid = e.worker_pids()[0]
    op = prefetch(e, keys, range(4, 8))
    result["statuses"] = [int(s) for s in op.page_status]
    result["gone_answers"] = fuse.gone_answers
    result["same_worker"] = e.worker_pids()[0] == pid
    result["respawns"] = e.metrics()["respawns"]
    result["others_right"] = all(fingerprint(get(e, 4 + i)) == fingerprint(content(k, pb))
                                 for i, k in enumerate(keys[:3]))
    fuse.unmount()
"""


def test_a_page_gone_between_its_open_and_its_fstat_is_a_miss(tmp_path):
    """On a network filesystem (JuiceFS over FUSE) a page replaced by another
    node after this worker opened it can fail fstat with ENOENT: the read is a
    miss, as a vanished file is (decision 30), never an exception that kills
    the worker and fails every page it holds. A real FUSE directory over the
    page's fan-out leaf answers GETATTR of an opened file with ENOENT."""
    from faultkit import run_child
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse for a real FUSE filesystem")
    got = run_child(GONE_BODY, str(tmp_path), unprivileged=False)
    assert got["gone_answers"] >= 1, got             # the fstat reached the filesystem
    assert got["statuses"] == [st.OK, st.OK, st.OK, st.MISS], got
    assert got["same_worker"] and got["respawns"] == 0, got
    assert got["others_right"], got
