"""Fixtures of the scale-out suite: one JuiceFS volume per session, two mounts of it.

Every test gets its own store directory on the volume, seen through both
mounts (`nodes.a`, `nodes.b`: the same directory as node A and node B see it).
The volume is unmounted at the end of the session and the suite checks that
no JuiceFS client is left running.
"""
import itertools
import os
from dataclasses import dataclass

import pytest


import jfs  # noqa: E402

_serial = itertools.count()


@pytest.fixture(scope="session")
def volume(tmp_path_factory):
    why = jfs.unavailable()
    if why:
        pytest.skip(why)
    vol = jfs.Volume(str(tmp_path_factory.mktemp("jfs")), nodes=2)
    try:
        yield vol
    finally:
        meta = vol.meta
        vol.close()
        left = jfs.client_pids(meta)
        assert not left, f"juicefs clients left running: {left}"


@dataclass
class Nodes:
    a: str          # the store as node A mounts it
    b: str          # the same store as node B mounts it
    name: str


@pytest.fixture
def nodes(volume, request):
    name = f"store{next(_serial)}-{request.node.name[:40]}"
    a, b = (os.path.join(m, name) for m in volume.mounts)
    os.makedirs(a, mode=0o700)
    return Nodes(a, b, name)
