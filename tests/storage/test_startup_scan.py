"""Start-up on a large store (issue 47 §1, decision 110): the constructor does
not walk the store; a scanner process does, in the background, and until
its listing is in the index every answer is still right.

Stores of 20,000 and 8,000 tiny page files (hicache_mp.bench.bigstore,
written straight in the page-file format) on tmpfs (/dev/shm), built once
per module. Real workers, scanner and evictor processes; a scanner is held
back with SIGSTOP where a test must look while the scan runs.
"""
import os
import shutil
import signal
import time

import psutil
import pytest

from hicache_mp import EngineConfig, PageGeometry, PrefetchEngine
from hicache_mp.bench import bigstore
from hicache_mp.engine.index import StoreIndex
from hicache_mp.engine.storescan import TAKE_PER_POLL
from hicache_mp.integrations.vllm.lookup import Lookups
from workers import naming

GEOMETRY = PageGeometry(num_layers=1, num_kv_heads=1, head_dim=32, page_size=4,
                        dtype="bfloat16", layout="page_first")  # 512-byte pages
BIG = 20_000
EVICTED_STORE = 8_000


@pytest.fixture(scope="module")
def tmpfs():
    root = f"/dev/shm/test-startup-scan-{os.getpid()}"
    os.makedirs(root)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _config(store, **kw):
    return EngineConfig(storage_dir=store, num_workers=1, host_pool_pages=64, **kw)


@pytest.fixture(scope="module")
def big(tmpfs):
    store = os.path.join(tmpfs, "big")
    t0 = time.perf_counter()
    bigstore.build(store, GEOMETRY, bigstore.store_namespace(_config(store), GEOMETRY), BIG)
    print(f"\nbuilt {BIG} pages in {time.perf_counter() - t0:.2f} s")
    return store


def _scanner(eng) -> psutil.Process:
    """This process's store scanner child (by its command line)."""
    for child in psutil.Process().children():
        try:
            if "workers.scanner" in child.cmdline():
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError("no scanner process")


def _page_files(store) -> set:
    return {naming.digest_from_name(e.name) for sub in naming.fanout_dirs(store)
            for e in os.scandir(sub) if naming.digest_from_name(e.name)}


def _constructor_cpu(store) -> tuple[float, float, PrefetchEngine]:
    """(CPU seconds of this thread in the constructor, wall seconds, engine)."""
    c0, t0 = time.thread_time(), time.perf_counter()
    eng = PrefetchEngine(_config(store), GEOMETRY)
    return time.thread_time() - c0, time.perf_counter() - t0, eng


def test_the_constructor_does_not_walk_the_store(big, tmpfs):
    """The constructor returns before any of the store is in the index, and
    the scheduler thread's CPU in it does not grow with the store: at 20,000
    pages it is within half the old walk's cost of the empty store's (it was
    all of it and more).
    (CPU time, not wall time: the workers' start, which it waits for, is
    the same for both and varies with the machine's load.)"""
    empty = os.path.join(tmpfs, "empty")
    _constructor_cpu(empty)[2].close()  # the process's first engine pays one-time costs
    cpu0, wall0, eng = _constructor_cpu(empty)
    eng.close()
    cpu, wall, eng = _constructor_cpu(big)
    try:
        m = eng.metrics()
        assert m["index_pages"] == 0 and m["store_scan"]["state"] == "scanning", m["store_scan"]
        scanner = _scanner(eng).pid
        assert eng.wait_scanned(60)
        m = eng.metrics()
        assert m["index_pages"] == BIG and m["store_scan"]["pages"] == BIG
        assert m["store_scan"]["state"] == "done" and m["store_scan"]["complete"]
        # The scanner is gone once done, not left a zombie for the engine's life.
        deadline = time.monotonic() + 5
        while psutil.pid_exists(scanner) and time.monotonic() < deadline:
            eng.poll()
            time.sleep(0.01)
        assert not psutil.pid_exists(scanner)
    finally:
        eng.close()
    c1 = time.thread_time()
    assert StoreIndex(big).scan() == BIG
    walk = time.thread_time() - c1
    print(f"\nconstructor: empty store {wall0:.3f} s ({cpu0 * 1e3:.0f} ms CPU), {BIG} pages "
          f"{wall:.3f} s ({cpu * 1e3:.0f} ms CPU); the walk it used to make: {walk * 1e3:.0f} ms "
          f"CPU; scan whole after {m['store_scan']['seconds']:.2f} s")
    assert cpu - cpu0 < walk / 2, (cpu, cpu0, walk)


def test_answers_are_right_while_the_scan_is_held_back(big):
    """With the scanner stopped mid-scan, keys the index does not know yet
    are found through the workers' probes: exists() counts them (as SGLang's
    batch_exists and a plain caller ask), prefetch reads their bytes, vLLM's
    lookups say RETRY then HIT, and an absent key is a miss. Once the
    scanner goes on, the index holds exactly the store's pages."""
    eng = PrefetchEngine(_config(big), GEOMETRY)
    scanner = _scanner(eng)
    try:
        scanner.suspend()
        # keys the index does not know yet (it took at most a ring's worth)
        unknown = [i for i, known in enumerate(eng.present(
            [bigstore.page_key(i) for i in range(BIG)])) if not known]
        assert len(unknown) > BIG // 2
        sample, fresh = unknown[7:7 + 40 * 97:97], [bigstore.page_key(i) for i in unknown[:3]]
        keys = [bigstore.page_key(i) for i in sample]
        assert eng.exists(keys[:10]) == 10           # no wait asked for: it waits anyway
        assert eng.exists(keys[10:20], wait_s=0.1) == 10   # SGLang's batch_exists
        assert eng.exists(["startup-absent"] + keys[20:25]) == 0
        assert eng.exists_at_once(keys[25:30]) is None     # would wait: SGLang's fast path defers
        op = eng.prefetch(keys, list(range(len(keys))))
        assert eng.wait(op, 30) and op.status == "ok", op
        for slot, i in enumerate(sample):
            got = bytes(b"".join(eng.host_pool.page_iovecs(slot)))
            assert got == bigstore.payload(i, GEOMETRY.page_bytes), f"page {i}"
        vllm = Lookups(eng)
        assert [vllm.lookup(k) for k in fresh] == ["retry"] * 3
        vllm.flush()
        deadline = time.monotonic() + 10
        while eng.awaiting_discovery(fresh) and time.monotonic() < deadline:
            eng.poll()
            time.sleep(0.005)
        assert [vllm.lookup(k) for k in fresh] == ["hit"] * 3
        m = eng.metrics()["store_scan"]
        assert m["state"] == "scanning" and not m["complete"] and m["pages"] < BIG, m
        scanner.resume()
        # What one poll() takes of the listing is bounded, whatever is waiting.
        deadline = time.monotonic() + 10
        while eng.metrics()["store_scan"]["pages"] - m["pages"] < 2 * TAKE_PER_POLL and \
                time.monotonic() < deadline:
            before = eng.metrics()["store_scan"]["pages"]
            eng.poll()
            assert eng.metrics()["store_scan"]["pages"] - before <= TAKE_PER_POLL
            time.sleep(0.01)  # the scanner fills its ring again meanwhile
        assert eng.wait_scanned(60)
        assert eng.metrics()["index_pages"] == BIG
        assert eng.present([bigstore.page_key(i) for i in range(BIG)]).all()
        assert eng.exists(["startup-absent"]) == 0
    finally:
        if scanner.is_running() and scanner.status() == psutil.STATUS_STOPPED:
            scanner.resume()
        eng.close()
    assert not scanner.is_running() or scanner.status() == psutil.STATUS_ZOMBIE


def test_capacity_converges_exact_and_eviction_agrees_with_the_index(tmpfs):
    """A store twice over its limit at start: the evictor measures it in the
    background while the scan lists it. Once both are done the capacity
    figure says counted, the store is back under its limit, every page the
    evictor removed was reported (evicted_pages), and the index holds
    exactly the page files left: no page the scan listed before its eviction
    came back."""
    store = os.path.join(tmpfs, "evicted")
    ns = bigstore.store_namespace(_config(store), GEOMETRY)
    bigstore.build(store, GEOMETRY, ns, EVICTED_STORE)
    fb = bigstore.file_bytes(GEOMETRY)
    limit = EVICTED_STORE // 2 * fb
    eng = PrefetchEngine(_config(store, storage_max_bytes=limit, eviction_interval_s=0.2),
                         GEOMETRY)
    try:
        t0 = time.monotonic()
        assert eng.metrics()["store_scan"]["capacity"] in ("counting", "counted")
        last, still_since = -1, time.monotonic()
        while time.monotonic() - t0 < 60:
            eng.poll()
            m = eng.metrics()
            if m["evicted_pages"] != last:
                last, still_since = m["evicted_pages"], time.monotonic()
            if m["store_scan"]["state"] == "done" and m["store_scan"]["capacity"] == "counted" \
                    and last > 0 and time.monotonic() - still_since > 0.6:
                break
            time.sleep(0.002)
        m = eng.metrics()
        left = _page_files(store)
        assert m["store_scan"]["complete"] and m["store_scan"]["capacity"] == "counted", m
        assert len(left) * fb <= limit, (len(left), limit // fb)
        assert m["evicted_pages"] == EVICTED_STORE - len(left)
        assert m["store_bytes_estimate"] == len(left) * fb
        assert m["index_pages"] == len(left)
        keys = [bigstore.page_key(i) for i in range(EVICTED_STORE)]
        present = eng.present(keys)
        on_disk = [naming.key_digest(k, ns) in left for k in keys]
        assert present.tolist() == on_disk
        print(f"\n{EVICTED_STORE} pages over a limit of {limit // fb}: {m['evicted_pages']} "
              f"evicted, {len(left)} left, index {m['index_pages']}, estimate exact; "
              f"converged in {time.monotonic() - t0:.2f} s")
    finally:
        eng.close()


def test_a_scanner_that_dies_leaves_the_index_partial_and_answers_right(big):
    """A scanner killed mid-scan: the scan ends failed (never done), the
    index keeps what it listed, exists() still asks the workers about the
    rest, and the next rescan lists the whole store."""
    eng = PrefetchEngine(_config(big), GEOMETRY)
    try:
        _scanner(eng).send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while eng.metrics()["store_scan"]["state"] == "scanning" and time.monotonic() < deadline:
            eng.poll()
            time.sleep(0.01)
        m = eng.metrics()
        assert m["store_scan"]["state"] == "failed" and not m["store_scan"]["complete"], m
        assert m["index_pages"] < BIG
        keys = [bigstore.page_key(i) for i in range(BIG - 8, BIG)]
        assert eng.exists(keys) == 8
        assert eng.refresh() == BIG   # a rescan, by a scanner again
        assert eng.metrics()["store_scan"]["complete"]
    finally:
        eng.close()
