"""The scale-out suite's JuiceFS volume as a fixture wants it: skipped where
JuiceFS cannot run, and checked for clients left running once closed. The
volume itself is hicache_mp.bench.jfs's (bench_scaleout uses it too)."""
import contextlib

import pytest

from hicache_mp.bench.jfs import Volume, client_pids, unavailable


@contextlib.contextmanager
def volume_or_skip(root: str, nodes: int):
    """A Volume under `root` for a fixture; the test skips without JuiceFS, and
    fails if a client is still running once the volume is closed."""
    why = unavailable()
    if why:
        pytest.skip(why)
    vol = Volume(root, nodes=nodes)
    try:
        yield vol
    finally:
        meta = vol.meta
        vol.close()
        left = client_pids(meta)
        assert not left, f"juicefs clients left running: {left}"
