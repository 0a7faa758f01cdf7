"""Two engines in separate processes (two "nodes") share one store directory.

They back up overlapping keys concurrently while each prefetches the other's
pages, under different host layouts. Atomic rename is the only coordination,
so every page read must be a miss or byte-identical to what some writer wrote
for that key; afterwards each index must pick up the other's pages, one with
`refresh()`, one with `rescan_interval_s` alone.
"""
import multiprocessing as mp
import os
import time

import sharenode
from workers import tmpfiles
from faultkit import make, store_files


def test_two_engines_share_one_store(store):
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    nodes = [ctx.Process(target=sharenode.run, args=(store, 0, "page_first", 0.0, barrier, out)),
             ctx.Process(target=sharenode.run, args=(store, 1, "layer_first", 0.2, barrier, out))]
    for p in nodes:
        p.start()
    reports = [out.get(timeout=120) for _ in nodes]
    for p in nodes:
        p.join(30)
    for r in reports:
        assert "error" not in r, r["error"]
    for r in reports:
        assert r["wrong"] == 0 and r["final_wrong"] == 0 and r["torn"] == 0, r
        assert r["write_failed"] == 0 and r["read_ok"] > 0, r
        assert r["picked_up"], r
        assert r["final"] == {"ok": 32}, r
    refreshed = next(r for r in reports if r["node"] == 0)
    assert refreshed["known_before"] == 0, "the refresh() node knew the other's pages already"
    assert not store_files(store)[1]  # no temp file left by either node
    assert [p.exitcode for p in nodes] == [0, 0]


def test_scans_reap_only_temp_files_whose_writer_is_gone(store):
    """A scan never removes a temp file another engine is still writing: for a
    writer of this pid namespace it asks whether the pid lives; for another
    namespace or host (another container, another node of a shared
    filesystem), and for names that carry no owner, pids mean nothing here,
    so it waits until the file is an hour old."""
    me, dead = tmpfiles.owner(), _dead_pid()
    names = {"live": f"a.page.tmp.{os.getppid()}.{me}.t0.1", "dead": f"b.page.tmp.{dead}.{me}.t0.1",
             "legacy_dead": f"c.page.tmp.{dead}.1", "legacy_host": f"f.page.tmp.{dead}.node-a.1",
             "other_host": f"d.page.tmp.{dead}.nodeb-1234abcd-4026531836.t0.1",
             "other_host_old": f"e.page.tmp.{dead}.nodeb-1234abcd-4026531836.t0.2"}
    leaf = os.path.join(store, "ab", "cd")
    os.makedirs(leaf)
    for name in names.values():
        open(os.path.join(leaf, name), "wb").close()
    two_hours_ago = time.time() - 7200
    os.utime(os.path.join(leaf, names["other_host_old"]), (two_hours_ago, two_hours_ago))
    with make(store, pages=4, workers=1) as e:
        assert e.wait_scanned(30)  # the start's scan runs in the background (decision 110)
        left = set(os.listdir(leaf))
        assert e.metrics()["stale_tmp_removed"] == 2
    assert left == {names["live"], names["other_host"], names["legacy_dead"], names["legacy_host"]}


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid
