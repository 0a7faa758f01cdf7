"""The page_first_direct geometry (SGLang's zero-copy layout): runs, views and
files agree with the other layouts. Needs no SGLang."""

import pytest
import torch

from helpers import engine, fill, geometry, random_pages, read_back  # noqa: E402

from shm import new_owner_tag  # noqa: E402
from shm.hostpool import HostPool  # noqa: E402


@pytest.mark.parametrize("mla", [False, True])
def test_runs_match_the_page_view(mla):
    g = geometry("page_first_direct", mla=mla)
    pool = HostPool(g, 5, name=new_owner_tag() + ".pool", create=True)
    try:
        assert len(g.page_runs(0, 5)) == g.kv_count
        for p, page in enumerate(random_pages(g, 5, seed=3)):
            pool.page_view(p).copy_(page)
        for p in range(5):
            raw = b"".join(bytes(v) for v in pool.page_iovecs(p))
            assert raw == pool.page_view(p).contiguous().view(torch.uint8).numpy().tobytes()
    finally:
        pool.close()  # drops its tensor view first


@pytest.mark.parametrize("write_layout,read_layout", [("page_first_direct", "page_first"),
                                                      ("layer_first", "page_first_direct")])
def test_files_are_canonical_across_layouts(store, write_layout, read_layout):
    data = random_pages(geometry(), 6, seed=4)
    keys = [f"d{i}" for i in range(6)]
    with engine(store, write_layout, pages=8) as w:
        fill(w, range(6), data)
        op = w.backup(keys, list(range(6)))
        w.wait(op)
        assert op.status == "ok"
    with engine(store, read_layout, pages=8) as r:
        op = r.prefetch(keys, [7, 5, 3, 1, 0, 2])
        r.wait(op)
        assert op.status == "ok"
        assert torch.equal(read_back(r, [7, 5, 3, 1, 0, 2]), data)
