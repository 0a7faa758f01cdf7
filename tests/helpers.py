"""Small builders shared by tests: geometries, engines, random pages, and
what a child server left behind."""
import os
import time

import torch

from hicache_mp import EngineConfig, PageGeometry, make_engine

SMALL = dict(num_layers=3, num_kv_heads=2, head_dim=16, page_size=4, dtype="bfloat16")


def geometry(layout="page_first", **kw) -> PageGeometry:
    return PageGeometry(**{**SMALL, **kw, "layout": layout})


def engine(store, layout="page_first", backend="mp", pages=64, workers=2, **cfg):
    return make_engine(backend, EngineConfig(storage_dir=store, num_workers=workers,
                                             host_pool_pages=pages, **cfg), geometry(layout))


def random_pages(g: PageGeometry, n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((n, *g.page_shape), generator=gen).to(getattr(torch, g.dtype))


def fill(eng, slots, data) -> None:
    for slot, page in zip(slots, data):
        eng.host_pool.page_view(slot).copy_(page)


def backed_up(eng, n: int, seed: int):
    """`n` new keys whose random pages (slots 0..n-1) are written to the store;
    (keys, data)."""
    import os
    keys = [os.urandom(32).hex() for _ in range(n)]
    data = random_pages(eng.geometry, n, seed=seed)
    fill(eng, range(n), data)
    op = eng.backup(keys, list(range(n)))
    assert eng.wait(op, 60) and op.status == "ok"
    return keys, data


def read_back(eng, slots) -> torch.Tensor:
    views = [eng.host_pool.page_view(s).clone() for s in slots]
    return torch.stack(views) if views else torch.empty(0, *eng.geometry.page_shape, dtype=getattr(torch, eng.geometry.dtype))


def leftovers(pid: int, worker_pids, segments=()) -> tuple[list, list]:
    """/dev/shm entries a child server owned (by the owner pid in their names,
    or among `segments`) and its workers still alive (zombies are gone), after
    a short grace for exits."""
    import psutil

    from shm.names import list_ours, owner_pid
    deadline = time.monotonic() + 2.0
    while True:
        shm = sorted({n for n in list_ours() if owner_pid(n) == pid} |
                     {n for n in segments if os.path.exists(os.path.join("/dev/shm", n))})
        procs = []
        for w in worker_pids:
            try:
                if psutil.Process(w).status() != psutil.STATUS_ZOMBIE:
                    procs.append(w)
            except psutil.NoSuchProcess:
                pass
        if not (shm or procs) or time.monotonic() > deadline:
            return shm, procs
        time.sleep(0.05)
