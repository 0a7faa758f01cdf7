"""`hicache-mp import-sglang`: a store written by SGLang's real `file` backend
(HiCacheFile: raw pages, no header, host-layout byte order) converts, and
HiCacheMP then reads every page back byte for byte."""
import os

import pytest
import torch

try:
    import sglang.srt.mem_cache.hicache_storage as sgl_storage
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
except ImportError as exc:  # noqa: F841
    pytest.skip(f"SGLang is not importable ({exc}); install it with "
                f"`pip install --no-deps -r .ci/sglang-requirements.txt`", allow_module_level=True)

from sglang_pool import CpuMHAHostPool  # noqa: E402
from test_sglang import fill_random, logical, storage_config  # noqa: E402

from hicache_mp import cli  # noqa: E402

MODEL = "org/model-7b"
GEO = ["--num-layers", "3", "--num-kv-heads", "2", "--head-dim", "16", "--page-size", "4",
       "--dtype", "bfloat16"]


def sglang_file_store(src, layout, tp_size=2, pages_per_rank=4):
    """Write pages with SGLang's HiCacheFile from a host pool of `layout`; returns
    {(tp_rank, key): logical page tensor}."""
    written = {}
    for rank in range(tp_size):
        pool = CpuMHAHostPool(layout=layout, allocator_type="default")
        try:
            fill_random(pool, range(pages_per_rank), seed=100 + rank)
            cfg = storage_config(str(src), tp_rank=rank, tp_size=tp_size, model=MODEL,
                                 layout=layout, file_storage_path=str(src))
            hf = sgl_storage.HiCacheFile(cfg)
            for p in range(pages_per_rank):
                key = f"{rank}{p:063x}"  # SGLang keys: 64 hex chars
                assert hf.set(key, pool.get_data_page(p * pool.page_size, flat=True))
                written[(rank, key)] = logical(pool, p).clone()
        finally:
            pool.close()
    return written


def snapshot(d):
    return {e.name: (e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(d)}


@pytest.mark.parametrize("src_layout", ["page_first", "layer_first"])
def test_import_round_trip(tmp_path, capsys, src_layout):
    src, dst = tmp_path / "sglang", tmp_path / "mp"
    written = sglang_file_store(src, src_layout)
    # things the importer must skip and report
    (src / f"{'f' * 64}_{MODEL.replace('/', '-')}_0_2.bin").write_bytes(b"short")
    (src / f"{'e' * 64}_other-model_0_2.bin").write_bytes(b"x" * 1536)
    (src / f"{'d' * 64}.mamba_{MODEL.replace('/', '-')}_0_2.bin").write_bytes(b"x" * 1536)
    before = snapshot(src)

    argv = ["import-sglang", "--src", str(src), "--dst", str(dst), "--layout", src_layout,
            "--model", MODEL, "--tp-size", "2", *GEO]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert f"imported {len(written)} page(s)" in out
    assert "size does not match the geometry" in out
    assert "another model, rank or shard" in out
    assert "sidecar pool" in out
    assert snapshot(src) == before  # the source is never touched

    # a second run finds everything present
    assert cli.main(argv) == 0
    assert f"already in the destination store" in capsys.readouterr().out

    # read back through the SGLang backend, zero-copy, into the other layout
    read_layout = "layer_first" if src_layout == "page_first" else "page_first_direct"
    for rank in (0, 1):
        keys = [k for (r, k) in written if r == rank]
        pool = CpuMHAHostPool(layout=read_layout, allocator_type="shm")
        backend = StorageBackendFactory.create_backend(
            "dynamic", storage_config(str(dst), tp_rank=rank, tp_size=2, model=MODEL,
                                      layout=read_layout), pool)
        try:
            backend.register_mem_pool_host(pool)
            assert backend.zero_copy
            assert backend.batch_exists(keys) == len(keys)
            slots = list(range(len(keys)))
            assert backend.batch_get_v1(keys, pool.token_indices(slots)) == [True] * len(keys)
            for slot, key in zip(slots, keys):
                assert torch.equal(logical(pool, slot), written[(rank, key)])
        finally:
            backend.close()
            pool.close()


def test_import_refuses_bad_arguments(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    assert cli.main(["import-sglang", "--src", str(src), "--dst", str(src), "--layout",
                     "page_first", "--model", "m", *GEO]) == 2
    assert cli.main(["import-sglang", "--src", str(tmp_path / "nope"), "--dst", str(tmp_path / "d"),
                     "--layout", "page_first", "--model", "m", "--tp-size", "2", "--tp-rank", "2",
                     *GEO]) == 2
    assert "hicache-mp:" in capsys.readouterr().err
