"""Quick start: back pages up to a store, prefetch them into other slots, check the bytes.

Runs as it stands (python3 examples/quickstart.py): a temporary store, a small
geometry (256 KiB pages, a 16 MiB host pool), real worker processes.
The test suite runs it (tests/test_quickstart.py), so it cannot rot.
"""
import tempfile

import torch

from hicache_mp import EngineConfig, PageGeometry, PrefetchEngine

# Llama-3.1-8B would be PageGeometry(32, 8, 128, 64): 8 MiB pages, and its
# default 1024-page pool is 8 GiB of shared memory. Start small:
geometry = PageGeometry(num_layers=4, num_kv_heads=4, head_dim=64, page_size=64,
                        dtype="bfloat16", layout="page_first")          # 256 KiB pages
keys = [f"prefix-page-{i}" for i in range(16)]       # one key per page (SGLang: page hashes)

with tempfile.TemporaryDirectory() as store:
    config = EngineConfig(storage_dir=store, num_workers=2, host_pool_pages=64,
                          prefetch_policy="wait_complete")
    with PrefetchEngine(config, geometry) as engine:
        # Write: fill host slots 0-15, back them up, and wait for the backup:
        # close() would flush it too (up to 30 s), but only the op says "ok".
        pages = torch.randn(len(keys), *geometry.page_shape).to(torch.bfloat16)
        for slot, page in enumerate(pages):
            engine.host_pool.page_view(slot).copy_(page)
        backup = engine.backup(keys, range(16))
        assert engine.wait(backup, timeout_s=30) and backup.status == "ok", backup

        # Read: how many leading pages the store has (from memory, no syscalls),
        # then prefetch them into other slots; prefetch() returns at once.
        n = engine.exists(keys)
        slots = list(range(32, 32 + n))
        op = engine.prefetch(keys[:n], slots)
        while not op.ready():        # wait_complete: ready once every page is in
            engine.poll()            # microseconds; a scheduler calls it every step
            # ... the scheduler's own work goes here ...
        engine.wait(op)              # or block (GIL released) until the op is done

        assert op.status == "ok" and op.completed_pages == n == len(keys), op
        for slot, page in zip(slots, pages):
            assert torch.equal(engine.host_pool.page_view(slot), page)
        m = engine.metrics()
        print(f"{n} pages of {geometry.page_bytes // 1024} KiB written and read back byte for "
              f"byte by {m['workers']} workers ({m['read_bytes'] / 1e6:.1f} MB read)")
