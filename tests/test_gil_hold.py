"""The engine's calls on a scheduler's threads never let the GIL go.

Under a scheduler loop that holds the GIL, every release costs the calling
thread up to a switch interval to win it back (decision 74), so submitting,
draining and asking must keep it; only the one sleep of a blocking wait may
give it up. `giltrace.released_in` finds any C call (or operator line) during
which another thread ran, on the numpy and Python installed here.
"""
import threading
import time

import numpy as np
import pytest

import helpers
from faultkit import workers_counted
from hicache_mp.bench.giltrace import released_in
from shm import gilkeep

N = 128          # SGLang's STORAGE_BATCH_SIZE
KEYS = 2000      # a long request's key list, asked about at once


@pytest.fixture
def eng(tmp_path):
    with helpers.engine(str(tmp_path), pages=1024, workers=2,
                        prefetch_policy="wait_complete") as e:
        yield e


def _keys(n, tag="k"):
    return [f"{tag}{i:064x}" for i in range(n)]


def _settle(eng, op):
    assert eng.wait(op, timeout_s=30)
    time.sleep(0.15)  # past the health check's interval: the next poll runs it too


def test_sleep_releases_are_found():
    """The finder itself: a call during which another thread ran is named.

    One sleep(0) lets the GIL go for microseconds, and the finder's counter
    thread may not run inside them (on a busy machine it once did not), so
    the call sleeps until the counter has run twice (an increment between):
    seen by a profile hook that threading.setprofile puts on the threads
    started meanwhile, the counter being the only one. The counter runs
    only while this thread lets the GIL go, which it does only in its
    sleeps (or after holding it a whole switch interval, 0.5 s here, which a
    loop of sleeps does not). A finder that misses a release, or whose
    counter never runs, fails the assert (the loop gives up after 60 s)."""
    main = threading.get_ident()
    counter_looks = [0]  # the counter's `while not stop.is_set()`

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "is_set" and threading.get_ident() != main:
            counter_looks[0] += 1

    def sleep_until_the_counter_ran():
        deadline = time.monotonic() + 60
        while counter_looks[0] < 2 and time.monotonic() < deadline:
            time.sleep(0.001)

    threading.setprofile(hook)
    try:
        _, found = released_in(sleep_until_the_counter_ran, switch_s=0.5)
    finally:
        threading.setprofile(None)
    assert any("sleep" in what for _, what in found), found


def _each(*calls):
    """One fn that makes the next call each time it runs."""
    it = iter(calls)
    made = []

    def fn():
        made.append(next(it)())
        return made[-1]
    return fn, made


def test_submit_drain_and_ask_keep_the_gil(eng):
    keys = _keys(KEYS)
    batch = [keys[i * N:(i + 1) * N] for i in range(4)]
    fn, backups = _each(lambda: eng.backup(batch[0], range(0, N)),
                        lambda: eng.backup(batch[1], range(N, 2 * N)))
    _, found = released_in(fn)
    assert not found, f"backup submission let the GIL go: {found}"
    if len(backups) < 2:
        fn()
    for op in backups:
        _settle(eng, op)
    _, found = released_in(eng.poll)
    assert not found, f"a poll with the health check let the GIL go: {found}"
    fn, reads = _each(lambda: eng.prefetch(batch[0], range(2 * N, 3 * N)),
                      lambda: eng.prefetch(batch[1], range(3 * N, 4 * N)))
    _, found = released_in(fn)
    assert not found, f"prefetch submission let the GIL go: {found}"
    if len(reads) < 2:
        fn()
    workers_counted(eng, 4 * N)  # the workers finish, nothing drained: the next poll drains both

    _, found = released_in(eng.poll)
    assert not found, f"draining a batch let the GIL go: {found}"
    for op in reads:
        _settle(eng, op)
        assert op.status == "ok"
    _, found = released_in(eng.exists, keys, wait_s=0)
    assert not found, f"exists() over {KEYS} keys let the GIL go: {found}"
    present, found = released_in(eng.present, keys)
    assert not found, f"present() over {KEYS} keys let the GIL go: {found}"
    assert present[:2 * N].all() and not present[2 * N:].any()


def test_the_adapters_mask_steps_match_numpy_and_keep_the_gil():
    """shm.gilkeep's mask steps, which SGLang's and vLLM's adapters run per
    batch: numpy's answers at every size around a chunk, the GIL held over
    a long request's batch."""
    rng = np.random.default_rng(0)
    for n in (0, 1, gilkeep.CHUNK - 1, gilkeep.CHUNK, gilkeep.CHUNK + 1, KEYS):
        a, b = rng.random(n) < 0.5, rng.random(n) < 0.5
        status = rng.integers(0, 3, n).astype(np.uint8)
        assert np.array_equal(gilkeep.either(a, b), a | b)
        for value, want in ((True, np.flatnonzero(a)), (False, np.flatnonzero(~a))):
            got = gilkeep.where(a, value)
            assert got.dtype == np.int64 and np.array_equal(got, want), (n, value)
        assert np.array_equal(gilkeep.eq(status, 1), status == 1)

    def steps():
        return (gilkeep.either(a, b), gilkeep.where(a), gilkeep.where(a, False),
                gilkeep.eq(status, 1))
    _, found = released_in(steps)
    assert not found, f"a mask step over {KEYS} pages let the GIL go: {found}"


def test_the_tracer_tells_a_wait_that_timed_out_from_one_that_was_woken():
    """GilTracer: a Condition wait that ends by its timeout (an idle thread's
    poll) is recorded as "timeout", one that a notify ended as a "c_call",
    so a round's count of hand-offs is not its idle threads' polls."""
    import threading
    from hicache_mp.bench.giltrace import GilTracer
    tr = GilTracer().install()
    cond = threading.Condition()
    woken = []
    try:
        def idle():
            with cond:
                woken.append(cond.wait(0.05))      # nobody notifies: times out

        def handed():
            with cond:
                woken.append(cond.wait(10))        # notified below
        with tr.round("r"):
            a = threading.Thread(target=idle)
            a.start()
            a.join(10)
            b = threading.Thread(target=handed)
            b.start()
            time.sleep(0.05)
            with cond:
                cond.notify_all()
            b.join(10)
    finally:
        tr.uninstall()
    assert woken == [False, True]
    kinds = sorted(r[3] for r in tr.records if r[0] == "r" and "acquire" in r[5])
    assert kinds == ["c_call", "timeout"], tr.records
