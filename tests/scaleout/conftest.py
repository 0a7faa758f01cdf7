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


import jfskit

_serial = itertools.count()


@pytest.fixture(scope="session")
def volume(tmp_path_factory):
    with jfskit.volume_or_skip(str(tmp_path_factory.mktemp("jfs")), nodes=2) as vol:
        yield vol


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
