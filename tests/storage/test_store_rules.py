"""Store rules a server relies on: eviction order that survives a clock
going back, O_DIRECT on a store that cannot be written, and a setting that
refuses pages stored without a checksum."""
import os
import subprocess
import time

import pytest

from faultkit import backup, content, fingerprint, get, make, page_file, prefetch, settle, \
    store_files
from storagekit import ALIGNED, FILE_BYTES, mount, umount
from workers import status as st

DAY = 86400


def test_pages_used_now_outlive_cold_pages_that_carry_future_times(store):
    """#17.4: cold pages stamped a day ahead (the clock went back since, or
    the files came from elsewhere) are evicted before pages just read or
    just written, whose stamps are "now"."""
    limit = 40 * FILE_BYTES  # headroom 4 files: 37 files wake the evictor, it frees down to 32
    with make(store, geo=ALIGNED, pages=32, workers=2, storage_max_bytes=limit,
              eviction_interval_s=0.2) as e:
        cold = [f"cold{i}" for i in range(20)]
        backup(e, cold, range(20))
        ahead = time.time() + DAY
        for k in cold:
            os.utime(page_file(e, k), (ahead, ahead))
        read = [f"read{i}" for i in range(4)]
        backup(e, read, range(4))
        time.sleep(0.05)
        assert prefetch(e, read, range(20, 24)).status == "ok"  # stamps them now
        # 38 files: past the evictor's wake-up (37), two files short of the limit, so
        # a store estimate a file or two high mid-pass cannot drop a write.
        written = [f"new{i}" for i in range(14)]
        assert backup(e, written, range(14)).status == "ok"
        assert settle(lambda: e.poll() is not None and e.metrics()["evicted_pages"] >= 5, 10), \
            (e.metrics(), len(store_files(store)[0]))
        gone = lambda keys: [k for k in keys if not os.path.exists(page_file(e, k))]  # noqa: E731
        assert gone(read) == [] and gone(written) == [], (gone(read), gone(written))
        assert len(gone(cold)) == e.metrics()["evicted_pages"] >= 5


@pytest.fixture
def tmpfs(tmp_path):
    mnt = str(tmp_path / "mnt")
    os.mkdir(mnt)
    if not mount(mnt, "tmpfs", "size=8m", "mode=0700"):
        pytest.skip("cannot mount tmpfs here (needs root)")
    yield mnt
    umount(mnt)


def _read_only(mnt):
    subprocess.run(["mount", "-o", "remount,ro", mnt], check=True)


def _full(mnt):
    with open(os.path.join(mnt, "ballast"), "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass
    open(os.path.join(mnt, "ballast2"), "wb").close()  # inodes are left: only bytes are full


@pytest.mark.parametrize("spoil, write_status", [(_read_only, "denied"), (_full, "nospace")],
                         ids=["read_only", "full"])
def test_direct_io_on_starts_on_a_store_it_cannot_write_and_serves_reads(tmpfs, spoil,
                                                                         write_status):
    """#17.5: direct_io="on" on a full or read-only store starts (no write
    probe is possible; a page already there is read O_DIRECT instead), reads
    byte-exact, and the error comes with the first write, as its status."""
    keys = [f"d{i}" for i in range(6)]
    with make(tmpfs, geo=ALIGNED, pages=16, direct_io="on") as e:
        if not e.direct_io:
            pytest.skip("this kernel's tmpfs refuses O_DIRECT")
        assert backup(e, keys, range(6)).status == "ok"
    spoil(tmpfs)
    with make(tmpfs, geo=ALIGNED, pages=16, direct_io="on") as e:
        assert e.direct_io, e.direct_io_reason
        op = prefetch(e, keys, range(6))
        assert op.status == "ok", op.status_counts()
        pb = e.geometry.page_bytes
        assert [fingerprint(get(e, s)) for s in range(6)] == [fingerprint(content(k, pb)) for k in keys]
        w = backup(e, ["new"], [7])
        assert w.status_counts() == {write_status: 1}
    assert not store_files(tmpfs)[1]


def test_require_checksum_refuses_pages_stored_without_one(store):
    """#17.6: with require_checksum, a page written without a checksum is
    refused (status unverified, a miss; the file stays for other readers);
    pages with one are read, and this engine's own backups carry one."""
    with make(store, pages=16, write_checksum=False) as old:
        backup(old, ["bare0", "bare1"], [0, 1])
    with make(store, pages=16, write_checksum=True) as summed:
        backup(summed, ["summed"], [0])
    with make(store, pages=16, require_checksum=True) as e:
        op = prefetch(e, ["bare0", "summed", "bare1"], [2, 3, 4])
        assert [st.NAMES[int(c)] for c in op.page_status] == ["unverified", "ok", "unverified"]
        assert e.metrics()["misses"] == 2 and e.exists(["bare0"]) == 0  # the index healed
        assert os.path.exists(page_file(e, "bare0"))
        assert backup(e, ["bare0"], [5]).status == "ok"  # written again, now with a checksum
        assert prefetch(e, ["bare0"], [6]).status == "ok"
        assert fingerprint(get(e, 6)) == fingerprint(content("bare0", e.geometry.page_bytes))
    with make(store, pages=16) as plain:  # the default still serves unchecksummed pages
        assert prefetch(plain, ["bare1"], [0]).status == "ok"


def test_require_checksum_reaches_the_config_from_the_flag_and_checks_its_type():
    import argparse
    from hicache_mp.engine.config import EngineConfig, add_engine_flags, engine_options, sglang_options
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    on = engine_options(p.parse_args(["--hicache-mp-require-checksum", "true"]))
    assert on["require_checksum"] is True
    assert engine_options(p.parse_args([]))["require_checksum"] is False
    assert sglang_options({"require_checksum": "true"}) == {"require_checksum": "true"}
    assert EngineConfig(storage_dir="/tmp/x", host_pool_pages=4,
                        **sglang_options({"require_checksum": "true"})).require_checksum is True
    with pytest.raises(ValueError, match="require_checksum"):
        EngineConfig(storage_dir="/tmp/x", host_pool_pages=4, require_checksum="maybe")
