"""Bad page files are misses, counted by cause, and never wrong bytes.

Each case writes a good page, damages its file, and prefetches it beside an
intact page: the damaged one must end with its miss status (its slot never
reported as landed), `metrics()` must count it under that cause, the index
must forget it, and the intact one must still come back exactly.
Optionally (`quarantine_bad_files`) damaged files are moved aside.
"""
import os
import shutil
import stat
import struct
import zlib

import pytest

from workers import naming, pagefile
from workers import status as st

from faultkit import content, fingerprint, get, make, page_file, prefetch, backup, \
    run_child

H = pagefile.HEADER_SIZE
PB = 2 * 3 * 4 * 2 * 16 * 2  # TINY geometry page bytes (checked below)


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    store = str(tmp_path_factory.mktemp("badfiles"))
    with make(store, pages=8, workers=2, write_checksum=True) as e:
        assert e.geometry.page_bytes == PB
        yield e


def _truncate(at):
    def damage(path, eng, key):
        os.truncate(path, at)
    damage.__name__ = f"truncate_at_{at}"
    return damage


def _flip(at):
    def damage(path, eng, key):
        with open(path, "r+b") as f:
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0x40]))
    damage.__name__ = f"flip_byte_{at}"
    return damage


def _append(path, eng, key):
    with open(path, "ab") as f:
        f.write(b"\0")


def _header_with(eng, key, *, fp=None, version=None, payload_len=None):
    """A well-formed header (valid checksum) whose fields say something else."""
    digest = naming.key_digest(key, eng.namespace)
    hdr = pagefile.build_header(payload_len or eng.geometry.page_bytes,
                                fp or eng.geometry.fingerprint(), digest)
    if version is not None:
        struct.pack_into("<I", hdr, 8, version)
        struct.pack_into("<I", hdr, H - 4, zlib.crc32(memoryview(hdr)[:H - 4]))
    return bytes(hdr)


def _other_geometry(path, eng, key):
    other = eng.geometry.__class__(num_layers=4, num_kv_heads=2, head_dim=16, page_size=4)
    with open(path, "wb") as f:
        f.write(_header_with(eng, key, fp=other.fingerprint(), payload_len=other.page_bytes))
        f.write(b"\1" * other.page_bytes)


def _other_version(path, eng, key):
    with open(path, "r+b") as f:
        f.write(_header_with(eng, key, version=pagefile.VERSION + 1))


def _other_key(path, eng, key):
    shutil.copyfile(page_file(eng, "intact"), path)  # a whole, valid page, of another key


def _zero_length(path, eng, key):
    os.truncate(path, 0)


def _directory(path, eng, key):
    os.unlink(path)
    os.mkdir(path)


CASES = [
    # truncated anywhere: before, inside and at the end of the header, inside the payload
    *[(_truncate(at), "corrupt") for at in (1, 7, 100, H - 5, H - 1, H, H + 1, H + PB // 2,
                                            H + PB - 1)],
    (_append, "corrupt"),                                     # longer than a page
    # a flipped bit in each header field, in the padding and in the header checksum
    *[(_flip(at), "corrupt") for at in (0, 9, 13, 17, 30, 50, 73, 77, 2000, H - 2)],
    # a flipped bit in the payload: caught by the payload checksum
    *[(_flip(at), "corrupt") for at in (H, H + PB // 2, H + PB - 1)],
    (_other_geometry, "foreign"),
    (_other_version, "foreign"),
    (_other_key, "wrong_key"),
    (_zero_length, "corrupt"),
    (_directory, "unreadable"),
]


@pytest.mark.parametrize("damage,cause", CASES, ids=[c[0].__name__ for c in CASES])
def test_bad_file_is_a_counted_miss(eng, damage, cause):
    key = f"victim-{damage.__name__}"
    assert backup(eng, ["intact", key], [0, 1]).status == "ok"
    assert eng.exists([key]) == 1
    damage(page_file(eng, key), eng, key)
    before = eng.metrics()
    op = prefetch(eng, [key, "intact"], [2, 3])
    assert st.NAMES[int(op.page_status[0])] == cause, op.status_counts()
    assert op.completed_pages == 0 and op.status == "failed"
    assert get(eng, 3) == content("intact", PB)        # the good page beside it is exact
    after = eng.metrics()
    assert after["read_status"].get(cause, 0) == before["read_status"].get(cause, 0) + 1
    assert after["misses"] == before["misses"] + 1
    assert eng.exists([key]) == 0                       # the index forgot it
    again = prefetch(eng, [key], [2])                  # and it stays a miss, never wrong bytes
    assert again.page_status[0] != st.OK


def test_checksums_off_still_catch_structural_damage(tmp_path):
    """Without payload checksums only a flipped payload byte goes unnoticed
    (documented); truncation and header damage are still misses."""
    with make(str(tmp_path), pages=4, workers=1) as e:
        for damage in (_truncate(H + PB - 1), _flip(50), _zero_length, _append, _other_key):
            key = f"plain-{damage.__name__}"
            backup(e, ["intact", key], [0, 1])
            damage(page_file(e, key), e, key)
            op = prefetch(e, [key], [2])
            assert op.page_status[0] != st.OK, damage.__name__


def test_bad_files_are_moved_aside_when_asked(tmp_path):
    store = str(tmp_path)
    qdir = os.path.join(store, naming.QUARANTINE_DIR)
    with make(store, pages=8, workers=2, write_checksum=True, quarantine_bad_files=True) as e:
        moved = {"trunc": _truncate(H + 3), "flip": _flip(H + 5), "geo": _other_geometry,
                 "key": _other_key}
        kept = {"dir": _directory}  # not a page file at all: left for a human
        for name, damage in {**moved, **kept}.items():
            backup(e, ["intact", name], [0, 1])
            damage(page_file(e, name), e, name)
        op = prefetch(e, list(moved) + list(kept) + ["intact"], range(2, 8))
        assert [st.NAMES[int(s)] for s in op.page_status] == \
            ["corrupt", "corrupt", "foreign", "wrong_key", "unreadable", "ok"]
        for name in moved:
            assert not os.path.exists(page_file(e, name))
        assert os.path.isdir(page_file(e, "dir"))
        aside = sorted(os.listdir(qdir))
        assert len(aside) == len(moved) and all(naming.digest_from_name(n) is None for n in aside)
        assert stat.S_IMODE(os.stat(qdir).st_mode) == 0o700
        again = prefetch(e, list(moved), range(2, 6))   # now plain misses
        assert set(again.status_counts()) == {"miss"}
        assert e.refresh() == 1                         # quarantined files, a directory: not pages
        assert fingerprint(get(e, 7)) == fingerprint(content("intact", PB))


UNREADABLE_BODY = """
import os
from faultkit import backup, make, page_file, prefetch
with make(args[0], pages=4, workers=1) as e:
    backup(e, ["locked", "open"], [0, 1])
    os.chmod(page_file(e, "locked"), 0o200)   # write-only: the owner may not read it
    op = prefetch(e, ["locked", "open"], [2, 3])
    result["status"] = op.status_counts()
    result["first"] = int(op.page_status[0])
    result["read_status"] = e.metrics()["read_status"]
"""


def test_file_without_read_permission_is_a_counted_miss(tmp_path):
    got = run_child(UNREADABLE_BODY, str(tmp_path))
    assert got["first"] == st.UNREADABLE
    assert got["read_status"] == {"unreadable": 1, "ok": 1}
