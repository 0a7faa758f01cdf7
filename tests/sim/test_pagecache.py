"""The page-cache share the bench reports before a run: mincore on real files."""
import os

import pytest

from hicache_mp.bench.sim.pagecache import file_resident


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
