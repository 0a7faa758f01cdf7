"""Layer parts (decision 101): a page file read a layer group at a time, each
group into a host slot of its own, by real workers from real files.

What a user of SGLang's direct linker would notice: every group lands byte for
byte what the whole page holds (K and V, or MLA's one latent run), a missing
or damaged page is a miss or corrupt for each of its groups and never wrong
bytes, and a misuse is a clear error before any worker sees it.
"""
import os

import numpy as np
import pytest
import torch

from hicache_mp import EngineConfig, PageGeometry, PrefetchEngine
from workers.status import NAMES

PAGES = 3


def _engine(path, geometry, pages, **kw):
    return PrefetchEngine(EngineConfig(storage_dir=str(path), host_pool_pages=pages,
                                       num_workers=1, model_name="parts", **kw), geometry)


def _store(path, geometry):
    """Three pages of random bytes written whole; their payloads, by page."""
    rng = np.random.default_rng(7)
    with _engine(path, geometry, PAGES) as w:
        t = w.host_pool.tensor
        src = torch.from_numpy(rng.integers(-30000, 30000, tuple(t.shape), dtype=np.int16)
                               .view(np.float16))
        t.copy_(src)
        op = w.backup([f"p{i}" for i in range(PAGES)], list(range(PAGES)))
        w.wait(op)
        assert op.status == "ok"
    return src


def _read_groups(r, parts, keys):
    """Every group of `keys`, group-major: slot g*len(keys)+i holds group g of key i."""
    n = len(keys)
    op = r.prefetch([k for _ in range(parts) for k in keys], list(range(parts * n)),
                    parts=[g for g in range(parts) for _ in keys])
    r.wait(op)
    return op


@pytest.mark.parametrize("mla,parts", [(False, 4), (True, 2), (False, 8)])
def test_every_group_lands_the_whole_pages_bytes(tmp_path, mla, parts):
    g = PageGeometry(num_layers=8, num_kv_heads=1 if mla else 2, head_dim=16, page_size=4,
                     dtype="float16", layout="page_first", mla=mla)
    src = _store(tmp_path, g)
    group = 8 // parts
    with _engine(tmp_path, g, parts * PAGES, read_parts=parts) as r:
        assert r.host_pool.geometry.num_layers == group
        op = _read_groups(r, parts, [f"p{i}" for i in range(PAGES)])
        assert op.status == "ok" and op.completed_pages == parts * PAGES
        got = r.host_pool.tensor  # [slot, kv, group layers, token, head, dim]
        for part in range(parts):
            for i in range(PAGES):
                want = src[i][:, part * group:(part + 1) * group]
                assert torch.equal(got[part * PAGES + i].view(torch.int16),
                                   want.view(torch.int16)), (part, i)
        assert r.metrics()["worker_bytes"] == [parts * PAGES * g.layer_part(parts).page_bytes]


def test_a_missing_or_damaged_page_fails_each_group_and_the_rest_land(tmp_path):
    g = PageGeometry(num_layers=4, num_kv_heads=2, head_dim=8, page_size=4, dtype="float16")
    src = _store(tmp_path, g)
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs
                   if f.endswith(".page"))
    assert len(files) == PAGES
    with _engine(tmp_path, g, 2 * (PAGES + 1), read_parts=2) as r:
        damaged = files[0]  # one of the three, whichever key it holds
        with open(damaged, "r+b") as f:
            f.truncate(os.path.getsize(damaged) - 1)
        op = _read_groups(r, 2, ["p0", "p1", "p2", "absent"])
        statuses = [NAMES[int(c)] for c in op.page_status]
        by_key = {}
        for pos, s in enumerate(statuses):
            by_key.setdefault(op.keys[pos], set()).add(s)
        assert by_key["absent"] == {"miss"}
        bad = [k for k in ("p0", "p1", "p2") if by_key[k] != {"ok"}]
        assert len(bad) == 1 and by_key[bad[0]] == {"corrupt"}
        for pos, s in enumerate(statuses):  # every group that says ok holds its bytes
            if s == "ok":
                i, part = int(op.keys[pos][1:]), pos // 4
                assert torch.equal(r.host_pool.tensor[pos].view(torch.int16),
                                   src[i][:, part * 2:(part + 1) * 2].view(torch.int16))


def test_misuse_is_refused_before_any_worker(tmp_path):
    g = PageGeometry(num_layers=6, num_kv_heads=2, head_dim=8, page_size=4, dtype="float16")
    with pytest.raises(ValueError, match="divisor of 6"):
        _engine(tmp_path, g, 4, read_parts=4)
    with pytest.raises(ValueError, match="require_checksum"):
        _engine(tmp_path, g, 4, read_parts=2, require_checksum=True)
    with _engine(tmp_path, g, 4, read_parts=3) as r:
        with pytest.raises(ValueError, match="parts="):
            r.prefetch(["a"], [0])
        with pytest.raises(ValueError, match=r"\[0, 3\)"):
            r.prefetch(["a"], [0], parts=[3])
        with pytest.raises(ValueError, match="one per key"):
            r.prefetch(["a", "b"], [0, 1], parts=[0])
        with pytest.raises(ValueError, match="read_parts=1"):
            r.backup(["a"], [0])
    with _engine(tmp_path, g, 2) as w:
        with pytest.raises(ValueError, match="read_parts > 1"):
            w.prefetch(["a"], [0], parts=[0])
