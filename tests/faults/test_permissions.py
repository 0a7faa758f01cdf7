"""Owner-only by default: segments and semaphores 0600, store directories 0700,
page files 0600, whatever the umask; and another user can attach to nothing.

tests/test_engine_api.py checks the modes under the default umask. Here the
umask is 0 (the modes must not come from it), the store root is created by
the engine, and a second user (uid 65534, a forked child) tries to attach to
every segment and semaphore and to read the store.
"""
import os
import shutil
import stat
import tempfile

import pytest

from shm.names import list_ours

from faultkit import as_other_user, backup, make, page_file

NOBODY = 65534


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_owner_only_modes_under_a_permissive_umask(tmp_path):
    store = str(tmp_path / "not" / "yet" / "store")
    old = os.umask(0)
    try:
        with make(store, pages=4, workers=1, quarantine_bad_files=True) as e:
            names = [n for n in list_ours() if e.tag in n]
            assert any(n.startswith("sem.") for n in names) and any(n.endswith(".pool") for n in names)
            for n in names:
                assert _mode(os.path.join("/dev/shm", n)) == 0o600, n
            backup(e, ["p"], [0])
            assert _mode(store) == 0o700
            for d, dirs, files in os.walk(store):
                for x in dirs:
                    assert _mode(os.path.join(d, x)) == 0o700, x
                for x in files:
                    assert _mode(os.path.join(d, x)) == 0o600, x
    finally:
        os.umask(old)


@pytest.fixture
def open_parent():
    """A world-traversable parent (pytest's tmp dirs are 0700 already), so a
    refusal below comes from the store's own modes."""
    parent = tempfile.mkdtemp(prefix="hicache-perm-")
    os.chmod(parent, 0o755)
    yield parent
    shutil.rmtree(parent)


def test_another_user_cannot_attach_or_read(open_parent):
    store = os.path.join(open_parent, "store")
    with make(store, pages=4, workers=1) as e:
        backup(e, ["secret"], [0])
        names = [n for n in list_ours() if e.tag in n]
        path = page_file(e, "secret")

        def probe():
            import posix_ipc
            out = {}
            for n in names:
                try:
                    if n.startswith("sem."):
                        posix_ipc.Semaphore("/" + n[len("sem."):]).close()
                    else:
                        posix_ipc.SharedMemory("/" + n).close_fd()
                    out[n] = "attached"
                except posix_ipc.PermissionsError:
                    out[n] = "denied"
            for what, fn in (("store", lambda: os.listdir(store)), ("page", lambda: open(path, "rb"))):
                try:
                    fn()
                    out[what] = "read"
                except PermissionError:
                    out[what] = "denied"
            return out

        got = as_other_user(probe, NOBODY)
        assert "error" not in got, got
        assert len(got) == len(names) + 2 and set(got.values()) == {"denied"}, got
