"""Geometry and host pool: views, iovecs and canonical order agree in both layouts."""
import pytest
import torch

from shm import HostPool, PageGeometry, new_owner_tag

from helpers import geometry


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_iovecs_are_the_page_view_in_canonical_order(layout):
    g = geometry(layout)
    pool = HostPool(g, 5, name=new_owner_tag() + ".geo", create=True)
    try:
        pool.tensor.view(torch.int16).copy_(
            torch.arange(pool.tensor.numel(), dtype=torch.int32).to(torch.int16).view(pool.tensor.shape))
        for page in range(5):
            raw = b"".join(bytes(v) for v in pool.page_iovecs(page))
            logical = pool.page_view(page).contiguous().view(torch.uint8).numpy().tobytes()
            assert raw == logical
            assert len(raw) == g.page_bytes
        runs = sorted(r for p in range(5) for r in g.page_runs(p, 5))
        pos = 0
        for off, length in runs:  # every byte of the pool belongs to exactly one page
            assert off == pos
            pos += length
        assert pos == pool.nbytes
    finally:
        pool.close()


def test_llama_page_is_8_mib_and_layout_free_fingerprint():
    g = PageGeometry(32, 8, 128, 64, torch.bfloat16, "page_first")
    assert g.page_bytes == 8 * 1024 * 1024 and g.token_bytes == 131072
    assert g.fingerprint() == g.with_layout("layer_first").fingerprint()
    assert g.fingerprint() != PageGeometry(32, 8, 128, 32).fingerprint()
    assert PageGeometry(4, 1, 576, 64, "bfloat16", mla=True).page_shape == (1, 4, 64, 1, 576)


@pytest.mark.parametrize("bad", [dict(num_layers=0), dict(head_dim=-1), dict(dtype="int3"),
                                 dict(layout="token_first"), dict(page_size=2.5)])
def test_bad_geometry_is_refused(bad):
    with pytest.raises(ValueError):
        PageGeometry(**{**dict(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4), **bad})
