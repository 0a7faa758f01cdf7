"""O_DIRECT: the start-up probe, its fallbacks, and byte-exact direct round trips.

The probe must agree with what the filesystem really does (checked with a raw
O_DIRECT open beside it); a refusing filesystem (ramfs always; tmpfs before
Linux 6.6) must give buffered I/O with one log line under "auto" and a clear
error under "on"; an unaligned geometry must fall back the same way. On a
filesystem that accepts O_DIRECT, pages must round-trip byte for byte in every
layout, and the page cache must stay empty (the proof that O_DIRECT was used).
"""
import logging
import os

import pytest

from faultkit import backup, content, fingerprint, make, page_file, prefetch, store_files, \
    wrong_pages
from storagekit import ALIGNED, mount, raw_direct_ok, resident_pages, umount
from workers import directio

LAYOUTS = ("page_first", "layer_first", "page_first_direct")


def _allowed(e):
    return lambda k: {fingerprint(content(k, e.geometry.page_bytes))}


def _round_trip(e, prefix, n=6):
    keys = [f"{prefix}-{i}" for i in range(n)]
    assert backup(e, keys, range(n)).status == "ok"
    op = prefetch(e, keys, range(n, 2 * n))
    assert op.status == "ok", op.status_counts()
    assert not wrong_pages(e, op, _allowed(e))
    return keys


@pytest.fixture
def fs(tmp_path, request):
    """A freshly mounted filesystem of type request.param (tmpfs or ramfs)."""
    mnt = str(tmp_path / "mnt")
    os.mkdir(mnt)
    opts = ("size=64m", "mode=0700") if request.param == "tmpfs" else ("mode=0700",)
    if not mount(mnt, request.param, *opts):
        pytest.skip(f"cannot mount {request.param} here (needs root)")
    yield mnt
    umount(mnt)


def _direct_lines(caplog):
    return [r for r in caplog.records if r.name == "hicache_mp" and "O_DIRECT" in r.getMessage()]


@pytest.mark.parametrize("fs", ["tmpfs", "ramfs"], indirect=True)
def test_probe_agrees_with_the_filesystem_and_auto_falls_back(fs, caplog, request):
    caplog.set_level(logging.INFO, logger="hicache_mp")
    truth = raw_direct_ok(fs)
    if request.node.callspec.params["fs"] == "ramfs":
        assert not truth  # ramfs never does O_DIRECT: the fallback is always exercised
    assert directio.probe(fs)[0] == truth
    # "auto" is buffered on both: ramfs refuses, and a 64 MiB tmpfs fits in RAM.
    with make(fs, geo=ALIGNED, pages=16, storage_max_bytes=32 << 20) as e:
        assert not e.direct_io and not e.metrics()["direct_io"]
        _round_trip(e, "fs")
    lines = [r for r in caplog.records if r.name == "hicache_mp" and "buffered I/O" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]  # one line per engine, not per page
    if truth:
        assert "fits in RAM" in lines[0].getMessage() and lines[0].levelno == logging.INFO
        with make(fs, geo=ALIGNED, pages=16, direct_io="on") as e:  # the probe's yes is real
            assert e.direct_io
            _round_trip(e, "on")  # (tmpfs pages live in the page cache: no residency check)
    else:
        assert lines[0].levelno == logging.WARNING and "refused" in lines[0].getMessage()
    assert not [f for f in os.listdir(fs) if directio.PROBE_MARK in f]  # the probe cleaned up


def test_auto_uses_direct_only_for_a_store_that_can_outgrow_ram(store):
    ram = directio.ram_bytes()
    if not raw_direct_ok(store):
        pytest.skip("this disk refuses O_DIRECT")
    with make(store, geo=ALIGNED, pages=16, storage_max_bytes=ram // 2) as e:
        assert not e.direct_io and "fits in RAM" in e.direct_io_reason
    # No limit: buffered, however large the disk (a disk larger than RAM is the
    # norm, and the hot pages a server re-reads live in the page cache).
    with make(store, geo=ALIGNED, pages=16) as e:
        assert not e.direct_io and "--storage-max-bytes" in e.direct_io_reason
    with make(store, geo=ALIGNED, pages=16, storage_max_bytes=2 * ram) as e:
        assert e.direct_io
        _round_trip(e, "big")


@pytest.mark.parametrize("fs", ["ramfs"], indirect=True)
def test_direct_on_refused_is_an_error_at_start(fs):
    assert not raw_direct_ok(fs)
    with pytest.raises(ValueError, match="direct_io=on"):
        make(fs, geo=ALIGNED, pages=16, direct_io="on")
    with make(fs, geo=ALIGNED, pages=16, direct_io="off") as e:  # off never probes
        assert not e.direct_io
        _round_trip(e, "off")


def test_unaligned_geometry_falls_back_once(store, caplog):
    caplog.set_level(logging.INFO, logger="hicache_mp")
    with make(store, pages=16) as e:  # TINY: 1.5 KiB pages, nothing aligned
        assert not e.direct_io and "not multiples of 4096" in e.direct_io_reason
        _round_trip(e, "tiny")
    assert len([r for r in caplog.records if "not multiples of 4096" in r.getMessage()]) == 1
    with pytest.raises(ValueError, match="not multiples of 4096"):
        make(store, pages=16, direct_io="on")


disk_direct = pytest.mark.skipif(not raw_direct_ok(os.environ.get("TMPDIR", "/tmp")),
                                 reason="this machine's disk refuses O_DIRECT")


@disk_direct
@pytest.mark.parametrize("layout", LAYOUTS)
def test_direct_round_trip_is_byte_exact_and_bypasses_the_page_cache(store, layout):
    with make(store, layout=layout, geo=ALIGNED, pages=16, direct_io="on") as e:
        assert e.direct_io
        keys = _round_trip(e, layout)
        # Written with O_DIRECT and read back with O_DIRECT: not one page of these
        # files went through the page cache. Buffered I/O leaves them resident.
        assert sum(resident_pages(page_file(e, k)) for k in keys) == 0
    with make(store, layout=LAYOUTS[(LAYOUTS.index(layout) + 1) % 3], geo=ALIGNED, pages=16) as e:
        op = prefetch(e, keys, range(len(keys)))  # written under one layout, read under another
        assert op.status == "ok" and not wrong_pages(e, op, _allowed(e))


@disk_direct
def test_direct_reads_still_catch_short_and_long_files(store):
    with make(store, geo=ALIGNED, pages=16, direct_io="on") as e:
        keys = [f"len-{i}" for i in range(4)]
        backup(e, keys, range(4))
        full = os.path.getsize(page_file(e, keys[0]))
        with open(page_file(e, keys[0]), "ab") as f:
            f.write(b"x")                       # one byte too long (unaligned length)
        with open(page_file(e, keys[1]), "ab") as f:
            f.write(b"\0" * 4096)               # one block too long (aligned length)
        os.truncate(page_file(e, keys[2]), full - 100)   # short, unaligned
        os.truncate(page_file(e, keys[3]), full - 4096)  # short, aligned
        op = prefetch(e, keys, range(4, 8))
        assert op.status_counts() == {"corrupt": 4}, op.status_counts()
        assert not store_files(store)[1]
