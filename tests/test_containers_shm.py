"""Containers: a small /dev/shm, Docker's default 64 MiB (issue 33, finding 5).

Every shortfall is an error a container user can act on: it names the path,
the bytes needed and free, the part that does not fit (host pool, control
block, rings) and the fixes (`docker run --shm-size`, the emptyDir
`sizeLimit`, and the settings of what was started: the engine's, or SGLang's
extra-config keys), and nothing is left in /dev/shm: no segment, semaphore,
lock or registry entry. Run in a private 64 MiB tmpfs (tests/containerkit.py).
"""
import pytest

import containerkit
import early  # noqa: E402  (tests/early.py)

MIB = 2**20
SIZE_FIXES = ("--shm-size", "sizeLimit", "medium: Memory")


def _named(msg: str, *words) -> None:
    assert msg, "no error"
    for w in ("/dev/shm", "MiB needed", "MiB free of 64.0 MiB", *SIZE_FIXES, *words):
        assert w in msg, (w, msg)


def test_an_engine_too_large_for_64_mib_names_the_part_and_the_fixes(store):
    containerkit.require_namespaces()
    big = dict(pages=1200)  # 75 MiB of 64 KiB pages
    rings = dict(pages=640, workers=4, ring_capacity=65536)  # 40 MiB pool; 16 MiB rings each
    got = containerkit.in_private_shm("64m", "small_shm", {"store": store, "cases": [
        {**big, "workers": 0}, {**big, "workers": 2}, rings, {"pages": 8, "workers": 0}]})
    auto, explicit, ring, fits = got["cases"]
    for case in (auto, explicit):
        assert case["type"] == "ShmFullError", case
        _named(case["error"], "75.0 MiB", "host pool alone does not fit", "lower host_pool_pages")
    assert "auto gave" not in auto["error"]  # the pool is short, not the workers
    _named(ring["error"], "fit; not the rings of 4 workers", "fewer workers (num_workers",
           "ring_capacity (65536")
    assert "host_pool_pages" not in ring["error"], ring["error"]
    assert fits["error"] is None
    for case in got["cases"]:
        assert case["left"] == [], case  # nothing: no segment, lock, registry entry


def test_sglangs_attach_names_sglangs_settings():
    """Through SGLang's attach the fixes are SGLang's: its shm allocator or
    staging_pages for the staging pool, num_workers for the rings; never the
    engine's host_pool_pages, which SGLang has no way to set. The scenario
    (early.sglang_shm_cases) started with the session, in the background
    (tests/early.py, "sglang_small_shm"): it is mostly SGLang's import."""
    pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory")
    containerkit.require_namespaces()
    with early.finished("sglang_small_shm") as (run, rcs, errs):
        with open(run.path("stdout.0")) as f:
            got = containerkit.scenario_result(f.read(), errs[0], rcs[0])
    staged, zero_copy = got["cases"]
    _named(staged["error"], "host pool alone does not fit", '"allocator": "shm"',
           '"staging_pages"', "(50000 now)")
    _named(zero_copy["error"], "not the rings of 4 workers", '"num_workers"')
    assert "host pool" not in zero_copy["error"]  # SGLang's memfd is not in /dev/shm
    for case in got["cases"]:
        assert "host_pool_pages" not in case["error"], case["error"]
        assert case["left"] == [], case
