"""scripts/bench_storage.py runs end to end at --quick scale and writes its JSON.

Its two runs (the quick one and --mixed-only) start with the session, in the
background at nice 19 (tests/early.py, "bench_storage"): each is CPU work of
its own that the session's idle cores can carry. Their tests read them here,
or start them now when the session did not."""
import json
import os
import subprocess
import sys

import pytest

import early  # noqa: E402  (tests/early.py)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# --quick's data set is 64 MiB (256 pages); a quarter of it is still twice the
# 32-page host pool at every sweep point, and each pass writes, syncs and
# reads a quarter of the bytes (the full run: 22 s, now 10-13 s on 2 cores).
# Raw ceilings at 2 threads and processes only (--quick adds 4), one mixed
# pair (the mixed-only run, two): the same paths, fewer passes.


@pytest.fixture(scope="module")
def runs():
    """Both runs, waited for once: {"quick"|"mixed": (its stdout, its JSON
    report, what its directory holds)}."""
    with early.finished("bench_storage") as (run, rcs, errs):
        assert rcs == [0, 0], errs
        out = {}
        for i, name in enumerate(("quick", "mixed")):
            with open(run.path(f"stdout.{i}")) as f, \
                    open(os.path.join(run.path(name), "bs.json")) as j:
                out[name] = (f.read(), json.load(j), sorted(os.listdir(run.path(name))))
        yield out


def test_bench_storage_quick(runs):
    stdout, report, left = runs["quick"]
    assert report["schema"] == "hicache_mp.bench_storage/1"
    assert "cache_drop" in report
    # "on" is skipped where the disk refuses O_DIRECT; "off" always runs.
    assert set(report["modes"]) in ({"on", "off"}, {"off"})
    for name, mode in report["modes"].items():
        sweep = mode["sweep"]
        assert [(r["workers"], r["io_depth"]) for r in sweep] == [(1, 1), (1, 2), (2, 1), (2, 2)]
        for row in sweep:
            assert row["read_statuses"] == {"ok": report["pages"]}, row
            assert row["write_statuses"] == {"ok": report["pages"]}, row
        # The ceilings are the best of what was measured, and each ratio is the
        # best engine row over its ceiling, named by its workers and depth.
        assert {"threads_2", "procs_2"} <= set(mode["raw_read"]) and \
            {"threads_2", "procs_2"} <= set(mode["raw_write"])
        r = mode["ratios"]
        assert r["raw_read_gbps"] == max(v for v in mode["raw_read"].values() if v) > 0
        assert r["raw_write_gbps"] == max(v for v in mode["raw_write"].values() if v) > 0
        best_r = max(sweep, key=lambda row: row["read_gbps"])
        best_w = max(sweep, key=lambda row: row["write_gbps"])
        assert r["read_over_raw"] == best_r["read_gbps"] / r["raw_read_gbps"] > 0
        assert r["write_over_raw"] == best_w["write_gbps"] / r["raw_write_gbps"] > 0
        assert (r["read_best_workers"], r["read_best_io_depth"]) == \
            (best_r["workers"], best_r["io_depth"])
        assert (r["write_best_workers"], r["write_best_io_depth"]) == \
            (best_w["workers"], best_w["io_depth"])
        assert f"[direct_io={name}]" in stdout and \
            f"{r['read_over_raw']:.2f}  (target >= 0.90)" in stdout
        m = mode["mixed"]  # every read beside the writes came back ok
        assert m["read_with_writes"]["statuses"] == {"ok": report["pages"] * m["passes"]}, m
        assert r["mixed_read_over_read_only"] == m["ratio"]
    assert left == ["bs.json"]  # the JSON stays; the scratch directory went


def test_bench_storage_help_names_every_flag():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_storage.py"),
                           "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    for flag in ("--dir", "--workers", "--total-gib", "--direct-io", "--fsync", "--quick",
                 "--json", "--no-mixed", "--no-dd", "--raw-threads", "--dd-streams", "--io-depth"):
        assert flag in proc.stdout


def test_bench_storage_mixed_only_reports_the_ratio_per_mode(runs):
    """--mixed-only: reads alone and beside writes, in turn, the median ratio,
    and where the reads came from (buffered: the page cache; O_DIRECT: cold)."""
    stdout, report, left = runs["mixed"]
    assert left == ["bs.json"]
    assert "off" in report["modes"]
    for name, mode in report["modes"].items():
        m = mode["mixed"]
        assert m["reads_from"] == ("page cache" if name == "off" else "device (cold)")
        assert len(m["ratios"]) == 2 and m["ratio"] > 0
        assert mode["ratios"]["mixed_read_over_read_only"] == m["ratio"]
        for run in m["runs"]["read_with_writes"]:
            assert run["statuses"] == {"ok": report["pages"] * m["passes"]}, run
            assert run["write_pages"] > 0
    assert "read-only, reads from the page cache" in stdout
