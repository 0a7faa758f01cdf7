"""The page-cache share the bench reports before a run: mincore on real files."""
import os

import pytest

from hicache_mp import EngineConfig, PageGeometry, make_engine
from hicache_mp.bench.sim.pagecache import file_resident, resident_share
from hicache_mp.bench.sim.workload import make_workload
from workers import naming
from workers.stores import open_store


def test_a_file_just_read_is_resident_and_one_dropped_is_not(tmp_path):
    path = tmp_path / "page"
    size = (1 << 20) + 100           # a partial last memory page counts as one
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())         # clean pages: DONTNEED may drop them
    pages = -(-size // os.sysconf("SC_PAGE_SIZE"))
    path.read_bytes()
    assert file_resident(str(path)) == (pages, pages)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    have, total = file_resident(str(path))
    if have == total:
        pytest.skip("this filesystem keeps the pages (tmpfs): nothing to see dropped")
    assert total == pages and have < pages
    path.read_bytes()
    assert file_resident(str(path)) == (pages, pages)   # asking changed nothing; reading did


def test_an_empty_file_has_no_pages(tmp_path):
    path = tmp_path / "empty"
    path.write_bytes(b"")
    assert file_resident(str(path)) == (0, 0)


def test_the_share_of_a_requests_stored_pages_follows_what_was_read(tmp_path):
    g = PageGeometry(4, 2, 32, 16)   # 16 KiB pages: a few memory pages per file
    reqs = make_workload(2, scale=0.02)
    keys = [r.page_keys(16) for r in reqs]
    store = str(tmp_path / "store")
    with make_engine("mp", EngineConfig(storage_dir=store, num_workers=1,
                                        host_pool_pages=64), g) as eng:
        flat = keys[0] + keys[1]
        op = eng.backup(flat, range(len(flat)))
        assert eng.wait(op, 30) and op.status == "ok"
        ns = eng.namespace
    pages = open_store(store)
    paths = [[pages.path(naming.key_digest(k, ns)) for k in ks] for ks in keys]
    for _ in range(5):   # another job may drop the page cache between reading and asking
        for p in paths[0] + paths[1]:
            with open(p, "rb") as f:
                f.read()
        share = resident_share(pages, ns, reqs, 16)
        if share["all"] == 1.0:
            break
    assert share == {"first_request": 1.0, "all": 1.0}
    for p in paths[1]:   # the second request's pages dropped (written back first)
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    share = resident_share(pages, ns, reqs, 16)
    if share["all"] == 1.0:
        pytest.skip("this filesystem keeps the pages (tmpfs): nothing to see dropped")
    assert share["all"] < 1.0 and share["first_request"] <= 1.0
    # Keys of no stored page: nothing to measure.
    assert resident_share(pages, "another-namespace", reqs, 16) == \
        {"first_request": None, "all": None}
