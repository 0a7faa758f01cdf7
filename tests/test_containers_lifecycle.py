"""Containers: a restart over a surviving /dev/shm (issue 33, finding 1).

Run as a container runtime runs them (tests/containerkit.py): a private
tmpfs on /dev/shm that outlives the engines, each engine pid 1 of its own
PID namespace. Root only; skipped, with the reason, where unshare is refused.
"""
import containerkit


def test_ten_restarts_as_pid_1_over_one_dev_shm_each_start_and_leave_nothing(store):
    """A restarted container reuses pid 1, so kill(1, 0) said the dead engine
    lived and its 40 MiB pool filled the 64 MiB /dev/shm: every restart failed.
    Now each one removes its predecessor's segments, reads the page it wrote
    (the store outlives the container too), and the last leaves nothing."""
    containerkit.require_namespaces()
    got = containerkit.in_private_shm("64m", "restarts", {
        "store": store, "pages": 640, "times": 10, "workers": [0, 1]})  # auto, explicit: the last is auto
    runs = got["runs"]
    assert len(runs) == 11
    assert {r["pid"] for r in runs} == {1}
    assert runs[0]["stale_removed"] == 0
    assert all(r["stale_removed"] >= 6 for r in runs[1:]), runs  # pool, ctl, sem, rings, lock
    assert all(r["read_ok"] for r in runs[1:]), runs
    assert all(r["wrote"] == "ok" for r in runs), runs
    assert got["left"] == [], got["left"]


def _user_dirs(tmp_path):
    """A store for root and one uid 1000 may make (pytest's tmp dirs are 0700)."""
    import os
    import tempfile
    parent = tempfile.mkdtemp(prefix="hicache-users-")
    os.chmod(parent, 0o755)
    user = os.path.join(parent, "user")
    os.mkdir(user)
    os.chown(user, containerkit.USER, containerkit.USER)
    return parent, os.path.join(user, "store")


def test_a_non_root_engine_starts_beside_and_after_root_engines(store, tmp_path):
    """uid 1000 could not register in root's 0755 node registry beside a live
    root engine, and after root's engine was killed its clean-up died of
    posix_ipc.PermissionsError (no PermissionError) on root's leftovers. Now
    every start works, with explicit and automatic workers, bytes checked;
    root's leftovers that uid 1000 may not remove stay for root's next engine."""
    import shutil
    containerkit.require_namespaces()
    parent, user_store = _user_dirs(tmp_path)
    try:
        got = containerkit.in_private_shm("256m", "users", {"root_store": store,
                                                            "user_store": user_store})
    finally:
        shutil.rmtree(parent)
    for run in got["beside"] + got["after"]:
        assert run["wrote"] == "ok" and run["own_ok"], run
    assert [r["workers"] >= 1 for r in got["beside"]] == [True, True]
    assert got["after"][0]["workers"] == 2
    # root's killed engine left its segments and lock, and uid 1000 left them alone
    assert any(n.endswith(".lock") for n in got["root_left"]), got["root_left"]
    assert set(got["root_left"]) - {"hicache_mp-node"} <= set(got["user_left"]) | {
        n for n in got["root_left"] if n.startswith("hicache_mp-node/")}, got
    # root's next engine removes everything: its predecessor's, the older one's
    assert got["last"]["stale_removed"] >= 8 and got["last"]["own_ok"], got["last"]
    assert got["left"] == [], got["left"]
