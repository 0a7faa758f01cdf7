"""Backups that cannot be written: a full disk, a read-only mount, a directory
the engine may not write, a file-size limit.

Each must fail the pages in question with a clear status (nospace / denied),
leave no temp file and no partial page, log one line per cause (not one per
page, not one per op), keep serving reads, and work again once the cause is
gone.
"""
import errno
import os
import resource
import subprocess

import pytest

from faultkit import MID, backup, content, fingerprint, make, prefetch, run_child, store_files, \
    wrong_pages


def _mount(path, *opts):
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(opts), "tmpfs", path],
                       capture_output=True)
    return r.returncode == 0


@pytest.fixture
def small_fs(tmp_path):
    """A 320 KiB tmpfs: about four 64 KiB pages fit."""
    mnt = str(tmp_path / "mnt")
    os.mkdir(mnt)
    if os.geteuid() != 0 or not _mount(mnt, "size=320k", "mode=0700"):
        pytest.skip("cannot mount a tmpfs here (RLIMIT_FSIZE case still runs)")
    yield mnt
    subprocess.run(["umount", "-l", mnt], check=False)


def _lines(caplog, word):
    return [r for r in caplog.records if r.name == "hicache_mp" and word in r.getMessage()]


def _allowed(e):
    return lambda k: {fingerprint(content(k, e.geometry.page_bytes))}


def _check_store(e, keys, op):
    """Exactly the pages reported written are in the store, whole; nothing else."""
    pages, tmps = store_files(e.config.storage_dir)
    assert not tmps, f"temp files left: {tmps}"
    ok = [k for k, s in zip(keys, op.page_status.tolist()) if s == 1]
    assert len(pages) == len(ok)
    got = prefetch(e, keys, range(16, 16 + len(keys)))
    assert [s == 1 for s in got.page_status.tolist()] == [s == 1 for s in op.page_status.tolist()]
    assert not wrong_pages(e, got, _allowed(e))


def test_full_disk_fails_with_nospace_and_one_log_line(small_fs, caplog):
    keys = [f"full-{i}" for i in range(12)]
    with make(small_fs, geo=MID, pages=32, workers=2) as e:
        op = backup(e, keys, range(12))
        counts = op.status_counts()
        assert set(counts) == {"ok", "nospace"} and counts["nospace"] >= 6, counts
        assert op.status in ("partial", "failed")
        _check_store(e, keys, op)
        more = backup(e, [f"more-{i}" for i in range(8)], range(8))  # a second op, same cause
        assert set(more.status_counts()) == {"nospace"}
        assert len(_lines(caplog, "nospace")) == 1, [r.getMessage() for r in caplog.records]
        assert e.metrics()["write_status"]["nospace"] == counts["nospace"] + 8
        # Space comes back: the same keys back up fine.
        subprocess.run(["mount", "-o", "remount,size=4m", small_fs], check=True)
        assert backup(e, keys, range(12)).status == "ok"


def test_read_only_mount_denies_writes_and_still_serves_reads(small_fs, caplog):
    with make(small_fs, geo=MID, pages=32, workers=2) as e:
        old = ["ro-0", "ro-1"]
        assert backup(e, old, [0, 1]).status == "ok"
        subprocess.run(["mount", "-o", "remount,ro", small_fs], check=True)
        try:
            keys = old + [f"ro-new-{i}" for i in range(6)]  # existing and fresh fan-out dirs
            op = backup(e, keys, range(8))
            assert set(op.status_counts()) == {"denied"} and op.status == "failed"
            assert len(_lines(caplog, "denied")) == 1
            assert os.strerror(errno.EROFS) in _lines(caplog, "denied")[0].getMessage()
            got = prefetch(e, old, [8, 9])
            assert got.status == "ok" and not wrong_pages(e, got, _allowed(e))
        finally:
            subprocess.run(["mount", "-o", "remount,rw", small_fs], check=True)
        _check_store(e, old, backup(e, old, [0, 1]))  # rewriting works again; nothing else there


# Runs in a child without root's permission override: the store's directories
# turn read-only (0500), then backups must fail `denied` (EACCES).
READ_ONLY_DIR_BODY = """
import os
from faultkit import backup, capture_log, make, prefetch, store_files
log = capture_log()
root = args[0]
with make(root, pages=32, workers=2) as e:
    old = [f"old-{i}" for i in range(4)]
    backup(e, old, range(4))
    for d, _, _ in os.walk(root):
        os.chmod(d, 0o500)
    op = backup(e, old + [f"new-{i}" for i in range(12)], range(16))
    op2 = backup(e, [f"new2-{i}" for i in range(4)], range(4))
    result["statuses"] = [op.status_counts(), op2.status_counts()]
    result["flags"] = sorted({int(x) for x in op.page_status})
    result["tmp"] = store_files(root)[1]
    result["pages"] = len(store_files(root)[0])
    result["reads"] = prefetch(e, old, range(16, 20)).status
    for d, _, _ in os.walk(root):
        os.chmod(d, 0o700)
    result["after"] = backup(e, ["new-0"], [0]).status
result["log"] = log
"""


def test_read_only_directory_denies_writes_with_one_log_line(tmp_path):
    got = run_child(READ_ONLY_DIR_BODY, str(tmp_path / "store"))
    assert got["statuses"] == [{"denied": 16}, {"denied": 4}]
    assert got["tmp"] == [] and got["pages"] == 4 and got["reads"] == "ok"
    denied = [m for m in got["log"] if "denied" in m]
    assert len(denied) == 1 and os.strerror(errno.EACCES) in denied[0], got["log"]
    assert got["after"] == "ok"


def test_file_size_limit_fails_with_nospace(store, caplog):
    """RLIMIT_FSIZE (EFBIG): the full-disk case where no tmpfs can be mounted.

    The limit is put on the running workers (prlimit), not inherited from the
    engine: the engine's own shared-memory segments are files too, and would
    hit it. Python ignores SIGXFSZ, so a worker sees EFBIG instead of dying.
    """
    keys = [f"big-{i}" for i in range(10)]
    with make(store, geo=MID, pages=16, workers=2) as e:
        for pid in e.worker_pids():
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (32 * 1024, 32 * 1024))
        op = backup(e, keys, range(10))
        assert op.status_counts() == {"nospace": 10}
        assert store_files(store) == ([], [])  # no page, no temp file
        assert len(_lines(caplog, "nospace")) == 1
        assert e.metrics()["respawns"] == 0     # nobody died of SIGXFSZ
