"""The loop's floor (hicache_mp.bench.floor): plain readers that move given page bytes at a given pace.

Real files, real reader processes: a round moves every byte asked (each pass),
takes no less than its pace allows, a round after it reuses the same
processes, and nothing is left running or in /dev/shm after close().
"""
import os

import pytest

from hicache_mp.bench.floor import PacedReaders
from shm.names import SHM_DIR

PAGE = 64 << 10
HEADER = 4096


@pytest.fixture
def pages(tmp_path):
    paths = []
    for i in range(12):
        p = tmp_path / f"{i}.page"
        p.write_bytes(os.urandom(HEADER + PAGE))
        paths.append(str(p))
    return [(p, HEADER, PAGE) for p in paths]


def test_a_round_moves_every_byte_at_the_asked_pace_and_leaves_nothing(pages):
    shm_before = set(os.listdir(SHM_DIR))
    with PacedReaders(pages, 3, passes=2) as readers:
        assert readers.workers == 3 and readers.nbytes == 2 * 12 * PAGE
        pids = readers.pids
        for seconds in (0.3, 0.15):   # the same processes, round after round
            readers.start(seconds)
            got = readers.finish()
            assert got["bytes"] == readers.nbytes
            # each reader's last range starts at (n-1)/n of the round: never sooner
            assert got["seconds"] >= seconds * (8 - 1) / 8
            assert got["gbps"] == pytest.approx(got["bytes"] / got["seconds"] / 1e9)
    for pid in pids:   # joined by close(): gone, not even a zombie
        assert not os.path.exists(f"/proc/{pid}")
    assert set(os.listdir(SHM_DIR)) <= shm_before


def test_nothing_to_read_is_refused():
    with pytest.raises(ValueError):
        PacedReaders([], 2)
