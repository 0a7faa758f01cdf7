"""Stores shared by engines of several uids, and a store this uid cannot write.

Decision 100: a directory or page file the store makes copies the group bits
of the directory it is made in (never others' bits), whatever the umask. A
root made group-shared (root:GROUP 2770, as an operator or Kubernetes'
fsGroup makes it) is then shared by every engine whose uid is in GROUP: each
reads, overwrites and evicts the others' pages. Before, pages were 0600 and
fan-out directories 0700, so another uid read nothing. An engine over a
store directory it cannot write logs, once at start, a line that names the
directory, its owner and the fix; before, only `denied` (Permission
denied) with no path.

Real uids (`setpriv`) in a private mount namespace with its own /dev/shm
(tests/containerkit.py, `shared_store`); a read-only bind mount in a private
mount namespace. Root only; skipped, with the reason, where unshare is
refused.
"""
import os
import shutil
import subprocess
import sys
import tempfile

import containerkit
from workers import status as st

GROUP = containerkit.GROUP


def test_engines_of_two_uids_in_one_group_share_a_store(store):
    containerkit.require_namespaces()
    parent = tempfile.mkdtemp(prefix="hicache-shared-")
    try:
        os.chmod(parent, 0o755)           # pytest's tmp dirs are 0700: no other uid gets in
        shared = os.path.join(parent, "shared")
        os.mkdir(shared)
        os.chown(shared, 0, GROUP)
        os.chmod(shared, 0o2770)          # rwx for the group, setgid: what fsGroup makes
        got = containerkit.in_private_shm("256m", "shared_store", {"store": shared})
    finally:
        shutil.rmtree(parent)
    OK = st.OK
    assert got["a"]["wrote"] == [[OK, OK, OK]], got["a"]
    # uid USER + 1 reads uid USER's pages byte-exact, and overwrites one in place
    b = got["b"]
    assert b["read"] == [OK, OK, OK] and all(b["bytes"]), b
    assert b["wrote"] == [[OK, OK]], b
    a = got["a_again"]
    assert a["read"] == [OK, OK] and all(a["bytes"]), a
    # a uid outside the group reads nothing and writes nothing there
    stranger = got["stranger"]
    assert stranger["read"] != [OK] and stranger["wrote"] == [[st.DENIED]], stranger
    named = [w for w in stranger["warnings"] if "not writable" in w]
    assert len(named) == 1 and f"group {GROUP} among its groups" in named[0], stranger
    # the modes: the root's group bits all the way down, never others'
    modes = got["modes"]
    dirs = [m for m in modes if m[0] == "dir"]
    files = [m for m in modes if m[0] == "file"]
    assert len(dirs) >= 3 and len(files) == 4, modes
    assert all(m[2] == 0o2770 and m[3] == GROUP for m in dirs), dirs
    assert all(m[2] == 0o660 and m[3] == GROUP for m in files), files
    assert not any(warning for run in (got["a"], b, a) for warning in run["warnings"]
                   if "not writable" in warning), got
    assert _ours_left(got["left"]) == [], got["left"]


def test_a_store_directory_this_uid_cannot_write_is_named_once_with_the_fix(store):
    containerkit.require_namespaces()
    parent = tempfile.mkdtemp(prefix="hicache-rootowned-")
    try:
        os.chmod(parent, 0o755)
        root_owned = os.path.join(parent, "store")
        os.mkdir(root_owned)
        os.chmod(root_owned, 0o755)       # root's, as an image or an init container leaves it
        run = containerkit.in_private_shm("256m", "root_owned_store", {"store": root_owned})
    finally:
        shutil.rmtree(parent)
    assert run["wrote"] == [[st.DENIED], [st.DENIED]], run
    named = [w for w in run["warnings"] if "not writable" in w]
    assert len(named) == 1, run["warnings"]          # once, not per page or per op
    line = named[0]
    assert root_owned in line, line
    for words in ("not writable", "uid 1000", "owned by uid 0", "mode 0755", "denied",
                  f"chown -R 1000 {root_owned}", "chmod g+s", "decision 100",
                  "run the engine as the directory's owner (uid 0)"):
        assert words in line, (words, line)
    # the denied pages' own cause line (once) names the directory and the fix too
    causes = [w for w in run["warnings"] if "write: denied" in w]
    assert len(causes) == 1 and root_owned in causes[0] and "chown" in causes[0], run["warnings"]
    assert _ours_left(run["left"]) == [], run["left"]


def _ours_left(left: list) -> list:
    """Segments, semaphores and lock files in the private /dev/shm (the node
    registry's directory may stay)."""
    return [n for n in left if not n.startswith("hicache_mp-node")]


def test_a_store_on_a_read_only_mount_is_named_as_such(tmp_path):
    """A read-only bind mount of the store (in a private mount namespace):
    the start's words say read-only and name the directory, where uid and
    mode would mislead (root may write any mode, but not there)."""
    containerkit.require_namespaces()
    store = str(tmp_path / "ro")
    os.mkdir(store)
    script = ("import sys; from workers.store import write_problem; "
              "print(write_problem(sys.argv[1]))")
    cmd = (f'mount --bind "$1" "$1" && mount -o remount,ro,bind "$1" && '
           f'exec "$0" -c "{script}" "$1"')
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    got = subprocess.run(["unshare", "-m", "sh", "-c", cmd, sys.executable, store],
                         capture_output=True, text=True, timeout=60, cwd=root)
    assert got.returncode == 0, got.stderr
    line = got.stdout.strip()
    assert store in line and "read-only filesystem" in line and "denied" in line, line
    assert "mount it read-write" in line, line
