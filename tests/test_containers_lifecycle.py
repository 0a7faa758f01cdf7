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
