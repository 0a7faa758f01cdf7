"""The file store under an operator's hands and other tenants: a wiped store,
symlinks, temp files of writers in other pid namespaces, and zombies.

Each test names the rule it protects; nothing here is mocked: real workers,
real files, real processes and pid namespaces.
"""
import os
import shutil
import subprocess
import sys
import time

import pytest

from faultkit import MID, backup, content, fingerprint, get, make, page_file, prefetch, store_files
from hicache_mp.engine.index import StoreIndex
from workers import naming, tmpfiles
from workers import status as st


def _wipe_contents(store):
    for name in os.listdir(store):
        shutil.rmtree(os.path.join(store, name))


def _remake(store):
    shutil.rmtree(store)
    os.mkdir(store, 0o700)


@pytest.mark.parametrize("io_depth", [1, 2])
@pytest.mark.parametrize("wipe", [_wipe_contents, _remake], ids=["rm_rf_contents", "dir_remade"])
def test_backups_keep_working_after_the_store_is_wiped(store, wipe, io_depth):
    """#11.2: fan-out directories are made again after `rm -rf store/*` or a
    store directory removed and made again, with no worker restart. The reads
    before the wipe left their leaf directories open in the workers (io_depth
    1): after it, those pages are misses, and once written again, the new
    pages' bytes, never an error or the old version."""
    keys = [f"w{i}" for i in range(16)]
    with make(store, pages=32, workers=2, io_depth=io_depth) as e:
        assert backup(e, keys, range(16)).status == "ok"
        assert prefetch(e, keys, range(16, 32)).status == "ok"
        pids = e.worker_pids()
        wipe(store)
        gone = prefetch(e, keys, range(16, 32))
        assert gone.status_counts() == {"miss": 16}, gone.status_counts()
        op = backup(e, keys, range(16), version=1)
        assert op.status == "ok", op.status_counts()
        r = prefetch(e, keys, range(16, 32))
        assert r.status == "ok", r.status_counts()
        pb = e.geometry.page_bytes
        assert [fingerprint(get(e, 16 + i)) for i in range(16)] == \
            [fingerprint(content(k, pb, version=1)) for k in keys]
        assert e.worker_pids() == pids  # the same workers did it


def test_a_page_file_that_is_a_symlink_reads_as_a_miss_with_no_byte_copied(store, tmp_path):
    """#11.10: page files are opened O_NOFOLLOW. The target here is a valid
    page of the same key, so following the link would report it landed."""
    outside = tmp_path / "outside"
    outside.mkdir()
    with make(store, pages=8, workers=1, geo=MID) as e:
        backup(e, ["k"], [0])
        path = page_file(e, "k")
        target = str(outside / "k.page")
        shutil.copy(path, target)
        os.unlink(path)
        os.symlink(target, path)
        op = prefetch(e, ["k"], [1])
        assert int(op.page_status[0]) == st.UNREADABLE, op.status_counts()
        assert get(e, 1) == b"\xa5" * e.geometry.page_bytes  # no byte of the target copied
        assert os.path.islink(path) and open(target, "rb").read(8) == b"HICMPPG1"


@pytest.mark.parametrize("level", [1, 2], ids=["top_level_dir", "leaf_dir"])
def test_a_fanout_dir_that_is_a_symlink_out_of_the_store_is_never_written_through(store, tmp_path,
                                                                                     level):
    """#11.10: each fan-out level is opened O_NOFOLLOW|O_DIRECTORY relative to
    the one above: a write there fails with a status, nothing is created
    outside the store, and reads through it are misses."""
    outside = tmp_path / "outside"
    outside.mkdir()
    with make(store, pages=8, workers=1) as e:
        path = page_file(e, "k")
        link = os.path.dirname(path) if level == 2 else os.path.dirname(os.path.dirname(path))
        os.makedirs(os.path.dirname(link), mode=0o700, exist_ok=True)
        os.symlink(str(outside), link)
        op = backup(e, ["k"], [0])
        assert int(op.page_status[0]) == st.IOERROR, op.status_counts()
        assert list(os.walk(outside)) == [(str(outside), [], [])]  # nothing created outside
        # A page planted outside, reached through the link, is not read either.
        os.unlink(link)
        backup(e, ["k"], [0])
        planted = os.path.join(str(outside), os.path.relpath(path, link))
        os.makedirs(os.path.dirname(planted), exist_ok=True)
        shutil.move(page_file(e, "k"), planted)
        shutil.rmtree(link)
        os.symlink(str(outside), link)
        r = prefetch(e, ["k"], [1])
        assert int(r.page_status[0]) in st.READ_MISSES, r.status_counts()
        assert get(e, 1) == b"\xa5" * e.geometry.page_bytes


def _zombie():
    """A child that has exited and is not reaped yet: (pid, reap)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat", "rb") as f:
            if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                break
        time.sleep(0.01)
    return pid, lambda: os.waitpid(pid, 0)


def test_a_zombie_writers_temp_file_is_removed(store):
    """#11.6: a writer that has exited counts as gone even before its parent reaps it."""
    pid, reap = _zombie()
    try:
        leaf = os.path.join(store, "ab", "cd")
        os.makedirs(leaf)
        mine = tmpfiles.tmp_name("ab" * 32 + naming.PAGE_SUFFIX, 1)
        zombie = mine.replace(f"{naming.TMP_MARK}{os.getpid()}.", f"{naming.TMP_MARK}{pid}.", 1)
        for name in (mine, zombie):
            open(os.path.join(leaf, name), "wb").close()
        index = StoreIndex(store)
        index.scan()
        assert sorted(os.listdir(leaf)) == [mine]  # ours lives on; the zombie's is gone
        assert index.stale_tmp_removed == 1
    finally:
        reap()


_NS_WRITER = """
import os, sys, time
target, leaf = int(sys.argv[1]), sys.argv[2]
from workers import naming, tmpfiles
# pids of a new namespace count up from 1: fork until this process holds `target`,
# a pid that is free in the parent's namespace (so a pid lookup there says dead).
while os.getpid() != target:
    child = os.fork()
    if child:
        os.waitpid(child, 0)
        if child >= target:
            sys.exit(0)
        continue
    if os.getpid() != target:
        os._exit(0)
path = os.path.join(leaf, tmpfiles.tmp_name("cd" * 32 + naming.PAGE_SUFFIX, 1))
open(path, "wb").close()
print(path, flush=True)
time.sleep(60)
"""


def test_a_live_writer_in_another_pid_namespace_keeps_its_temp_file(store):
    """#11.6: two containers with the same hostname share a store. The other
    namespace's writer is alive; its pid, looked up here, is not: a scan
    must judge its temp file by age, never by that pid."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) for a pid namespace")
    target = next(p for p in range(30, 5000) if not os.path.exists(f"/proc/{p}"))
    leaf = os.path.join(store, "cd", "cd")
    os.makedirs(leaf)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", _NS_WRITER,
                             str(target), leaf], stdout=subprocess.PIPE, text=True, env=env)
    try:
        path = proc.stdout.readline().strip()
        assert path and os.path.exists(path), "the writer in the new namespace did not start"
        assert tmpfiles.parse(os.path.basename(path))[0] == target
        index = StoreIndex(store)
        index.scan()
        assert os.path.exists(path), "a live writer's temp file was removed"
        two_hours_ago = time.time() - 7200
        os.utime(path, (two_hours_ago, two_hours_ago))
        index.scan()
        assert not os.path.exists(path)  # by age, once no write can still be going on
    finally:
        proc.kill()
        proc.wait()
