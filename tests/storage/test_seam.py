"""The page-store seam holds: the worker reaches files only through the store,
and a store kind is chosen by the spec alone (one registration line)."""
import os
import re

from workers.filestore import FileStore
from workers.stores import open_store
from workers.stripestore import StripedStore

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _source(rel):
    with open(os.path.join(ROOT, rel)) as f:
        return f.read()


def test_the_worker_makes_no_file_syscalls():
    """Issue 15's check: grep -n "os.open|os.pread|os.pwrite|preadv|pwritev" workers/worker.py."""
    hits = [line for line in _source("workers/worker.py").splitlines()
            if re.search(r"os\.open|os\.pread|os\.pwrite|preadv|pwritev", line)]
    assert hits == []


def test_only_the_registry_names_a_store_kind():
    """Neither the worker, the evictor nor the engine knows which stores exist."""
    for rel in ("workers/worker.py", "workers/evictor.py", "hicache_mp/engine/prefetch.py",
                "hicache_mp/engine/core.py", "hicache_mp/engine/index.py"):
        src = _source(rel)
        assert "filestore" not in src and "stripestore" not in src and "StripedStore" not in src, rel
    assert "StripedStore" in _source("workers/stores.py")


def test_open_store_picks_the_kind_by_spec(tmp_path):
    one, two = str(tmp_path / "a"), str(tmp_path / "b")
    assert type(open_store(one)) is FileStore
    striped = open_store(f"{one},{two}")
    assert type(striped) is StripedStore and striped.roots == [one, two]
    assert [p.roots for p in striped.parts()] == [[one], [two]]
    digests = [bytes([i]) * 32 for i in range(64)]
    assert {striped.part(d).root for d in digests} == {one, two}  # placement uses both
