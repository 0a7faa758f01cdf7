"""Discovery across nodes: an engine already running on node B finds pages node
A writes, within 2 s, without a restart and without walking the store in its
own (the scheduler's) process.

The walk check observes, it does not replace: os.scandir, os.listdir, os.walk
and os.stat of this process are wrapped to count calls (and then do what they
always do) while B waits for A's pages. Workers are other processes: their
stats are the mechanism under test (hicache_mp.engine.discovery).
"""
import os
import time

import pytest

from faultkit import MID, content, fingerprint, make, prefetch, put, wrong_pages

WATCHED = ("scandir", "listdir", "walk", "stat", "lstat")


@pytest.fixture
def fs_calls(monkeypatch):
    calls = {}

    def watch(name):
        real = getattr(os, name)

        def counted(*args, **kw):
            calls[name] = calls.get(name, 0) + 1
            return real(*args, **kw)
        return counted

    def start():
        for name in WATCHED:
            monkeypatch.setattr(os, name, watch(name))
        return calls

    yield start
    monkeypatch.undo()


def _backup(eng, keys, slots):
    for k, s in zip(keys, slots):
        put(eng, s, content(k, eng.geometry.page_bytes))
    op = eng.backup(keys, slots)
    assert eng.wait(op, 60) and op.status == "ok", op
    return op


def test_running_engine_on_b_finds_a_pages_within_2s_without_a_walk(nodes, fs_calls):
    keys = [f"late{i}" for i in range(32)]
    more = [f"later{i}" for i in range(16)]
    with make(nodes.b, geo=MID, pages=48) as b, make(nodes.a, geo=MID, pages=48) as a:
        assert b.exists(keys) == 0 and b.exists(more, wait_s=0.5) == 0  # asked: not there
        calls = fs_calls()
        _backup(a, keys, range(32))
        t0 = time.monotonic()
        while b.exists(keys) < len(keys) and time.monotonic() - t0 < 5:
            b.poll()          # a scheduler's loop: exists() and poll() only
            time.sleep(0.01)
        found_s = time.monotonic() - t0
        found = b.exists(keys)
        # One call that waits for the workers' answers finds a fresh run at once.
        _backup(a, more, range(16))
        t1 = time.monotonic()
        at_once = b.exists(more, wait_s=1.0)
        waited_s = time.monotonic() - t1
        walked = dict(calls)
        assert not walked, f"B's process touched the store itself: {walked}"
        assert found == len(keys), f"B found {found} of {len(keys)} pages in {found_s:.2f} s"
        assert found_s <= 2.0, f"B found A's pages after {found_s:.2f} s"
        assert at_once == len(more), f"exists(wait_s=1) found {at_once} after {waited_s:.2f} s"
        m = b.metrics()
        assert m["probes_found"] >= len(keys) + len(more) and m["index_pages"] == len(keys) + len(more)
        got = prefetch(b, keys + more, range(48))
        pb = b.geometry.page_bytes
        assert got.status == "ok"
        assert not wrong_pages(b, got, lambda k: {fingerprint(content(k, pb))})
    print(f"\ndiscovery: found 32 pages in {found_s:.3f} s by polling exists(); "
          f"16 more in {waited_s:.3f} s with one exists(wait_s=1)")
