"""A store striped over several directories (`storage_dir="/a,/b,/c"`, one per drive).

Pages go to a directory chosen by their digest, so a second engine started
on the same list reads what the first wrote; each directory fills, fails and
is evicted on its own, and a failed one ends its own pages as clean misses
while the others go on reading byte-exact.
"""
import os
import shutil

import pytest

from faultkit import MID, backup, content, fingerprint, get, make, page_file, prefetch, settle, \
    store_files
from storagekit import ALIGNED, FILE_BYTES, store_bytes
from hicache_mp import EngineConfig
from workers import status as st

KEYS = [f"stripe-{i}" for i in range(24)]


@pytest.fixture
def dirs(tmp_path):
    return [str(tmp_path / f"drive{i}" / "kv") for i in range(3)]


def _owner(dirs, path):
    return next(i for i, d in enumerate(dirs) if path.startswith(d + os.sep))


def test_pages_spread_over_every_directory_and_read_back_through_another_engine(dirs):
    spec = ",".join(dirs)
    with make(spec, pages=32, workers=2) as a:
        assert backup(a, KEYS, range(24)).status == "ok"
        where = [_owner(dirs, page_file(a, k)) for k in KEYS]
    counts = [len(store_files(d)[0]) for d in dirs]
    assert counts == [where.count(i) for i in range(3)] and all(counts), counts
    assert sum(counts) == len(KEYS)
    assert not any(store_files(d)[1] for d in dirs)  # no temp file left anywhere
    with make(spec, pages=32, workers=3) as b:
        assert b.exists(KEYS) == len(KEYS)  # the index scanned all three
        op = prefetch(b, KEYS, range(24))
        assert op.status == "ok", op.status_counts()
        pb = b.geometry.page_bytes
        assert [fingerprint(get(b, s)) for s in range(24)] == \
            [fingerprint(content(k, pb)) for k in KEYS]


def _fill_dir_with_a_file(path):
    shutil.rmtree(path)
    with open(path, "wb") as f:
        f.write(b"not a directory")


@pytest.mark.parametrize("break_it", [_fill_dir_with_a_file, shutil.rmtree],
                         ids=["replaced_by_a_file", "removed"])
def test_a_failed_directory_ends_its_pages_as_misses_the_others_read_exact(dirs, break_it):
    """Root ignores permissions, so a drive is made unusable by replacing or
    removing its directory while the engine runs."""
    spec = ",".join(dirs)
    with make(spec, pages=32, workers=2, geo=MID) as e:
        pb = e.geometry.page_bytes
        assert backup(e, KEYS, range(24)).status == "ok"
        where = [_owner(dirs, page_file(e, k)) for k in KEYS]
        break_it(dirs[1])
        op = prefetch(e, KEYS, range(24))
        for pos, k in enumerate(KEYS):
            code = int(op.page_status[pos])
            if where[pos] == 1:
                assert code in st.READ_MISSES, (k, st.NAMES[code])
                assert get(e, pos) == b"\xa5" * pb  # poisoned by prefetch(): no byte copied
            else:
                assert code == st.OK, (k, st.NAMES[code])
                assert fingerprint(get(e, pos)) == fingerprint(content(k, pb))
        assert e.metrics()["misses"] == where.count(1)
        # Writes: the broken directory's pages fail with a status, the others land.
        new = [f"after-{i}" for i in range(12)]
        w = backup(e, new, range(12))
        new_where = [_owner(dirs, page_file(e, k)) for k in new]
        for pos in range(12):
            want_ok = new_where[pos] != 1
            assert (int(w.page_status[pos]) == st.OK) == want_ok, (pos, st.NAMES[int(w.page_status[pos])])
        assert 0 < new_where.count(1) < 12
        r = prefetch(e, new, range(12, 24))
        assert [int(c) == st.OK for c in r.page_status] == [x != 1 for x in new_where]
    if os.path.isfile(dirs[1]):
        assert open(dirs[1], "rb").read() == b"not a directory"  # nothing written over it


def test_the_list_is_normalised_and_checked():
    cfg = EngineConfig(storage_dir="/tmp/a/../b, ~/c", host_pool_pages=4)
    assert cfg.storage_dir == "/tmp/b," + os.path.expanduser("~/c")
    for bad in ("/tmp/a,,/tmp/b", "/tmp/a,/tmp/a", "/tmp/a,"):
        with pytest.raises(ValueError):
            EngineConfig(storage_dir=bad, host_pool_pages=4)


def test_capacity_is_kept_per_directory(dirs):
    """Each directory is kept under its share of storage_max_bytes."""
    limit = 36 * FILE_BYTES  # 12 page files' worth per directory
    with make(",".join(dirs), geo=ALIGNED, pages=16, workers=2, storage_max_bytes=limit,
              eviction_interval_s=0.2) as e:
        for round_ in range(6):
            backup(e, [f"cap-{round_}-{i}" for i in range(16)], range(16))
        over = lambda: [store_bytes(d) for d in dirs if store_bytes(d) > limit // 3]  # noqa: E731
        assert settle(lambda: e.poll() is not None and not over(), 10), over()
        assert all(store_bytes(d) > 0 for d in dirs)
        assert e.metrics()["evicted_pages"] > 0
