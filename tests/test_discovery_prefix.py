"""Discovery finds a whole prefix another engine wrote in one exists() call.

SGLang's hit query stops at the first short answer, and a hybrid model's
trailing-page rule needs the prefix's last page: a prefix another engine wrote
must be found whole by one `exists(keys, wait_s=...)`, not a slice per call.
"""
import time

from hicache_mp.engine.discovery import PROBE_TTL_S
from helpers import engine, fill, random_pages, read_back

PAGES = 300   # longer than SGLang's 128-page storage batch and than any small probe cap


def test_one_exists_call_finds_a_whole_prefix_another_engine_wrote(store):
    keys = [f"prefix-{i}" for i in range(PAGES)]
    with engine(store, pages=PAGES) as reader:     # running before the pages exist
        assert reader.exists(keys) == 0
        with engine(store, pages=PAGES) as writer:
            data = random_pages(writer.geometry, PAGES, seed=7)
            fill(writer, range(PAGES), data)
            op = writer.backup(keys, range(PAGES))
            assert writer.wait(op, 60) and op.status == "ok", op
        # Past the negative cache of the reader's first call, ONE call finds them all.
        time.sleep(PROBE_TTL_S + 0.05)
        assert reader.exists(keys, wait_s=10.0) == PAGES
        op = reader.prefetch(keys, range(PAGES))
        assert reader.wait(op, 60) and op.status == "ok", op
        assert (read_back(reader, range(PAGES)) == data).all()


def test_one_exists_call_finds_a_2000_page_prefix_another_engine_wrote(store):
    """SGLang asks about a long request's whole key list at once (and a vLLM
    step's lookups of a 128K-token request are ~2,000 chunks): found in one
    call, not a PROBE_MAX slice per call."""
    n = 2000
    keys = [f"long-{i}" for i in range(n)]
    with engine(store, pages=n) as reader:
        assert reader.exists(keys) == 0
        with engine(store, pages=n) as writer:
            fill(writer, range(n), random_pages(writer.geometry, n, seed=9))
            op = writer.backup(keys, range(n))
            assert writer.wait(op, 60) and op.status == "ok", op
        time.sleep(PROBE_TTL_S + 0.05)
        assert reader.exists(keys, wait_s=10.0) == n


def test_a_cold_prefix_costs_the_store_one_stat_until_its_head_is_there(store):
    """A prefix whose first page is missing is no hit whatever follows: only its
    head is asked of the store; once the head is found, the rest is asked
    together, and the whole prefix is found in that one call."""
    keys = [f"cold-{i}" for i in range(PAGES)]
    with engine(store, pages=PAGES) as reader:
        assert reader.exists(keys, wait_s=2.0) == 0
        assert reader.metrics()["probes_sent"] == 1, reader.metrics()
        with engine(store, pages=PAGES) as writer:
            data = random_pages(writer.geometry, PAGES, seed=8)
            fill(writer, range(PAGES), data)
            op = writer.backup(keys[1:], range(1, PAGES))  # all but the head
            assert writer.wait(op, 60) and op.status == "ok", op
            time.sleep(PROBE_TTL_S + 0.05)
            assert reader.exists(keys, wait_s=2.0) == 0
            assert reader.metrics()["probes_sent"] == 2, reader.metrics()
            op = writer.backup(keys[:1], range(1))
            assert writer.wait(op, 60) and op.status == "ok", op
        time.sleep(PROBE_TTL_S + 0.05)
        assert reader.exists(keys, wait_s=10.0) == PAGES
        assert reader.metrics()["probes_sent"] == 2 + PAGES, reader.metrics()


def test_ask_finds_pages_behind_a_missing_head(store):
    """`ask()` (a sidecar pool's trailing pages) asks about every unknown key:
    pages another engine wrote behind a missing first page are found."""
    keys = [f"tail-{i}" for i in range(8)]
    with engine(store, pages=8) as reader, engine(store, pages=8) as writer:
        data = random_pages(writer.geometry, 8, seed=9)
        fill(writer, range(8), data)
        op = writer.backup(keys[4:], range(4, 8))
        assert writer.wait(op, 60) and op.status == "ok", op
        assert not reader.present(keys).any()
        reader.ask(keys, wait_s=10.0)
        assert reader.present(keys).tolist() == [False] * 4 + [True] * 4


def test_a_scheduler_polling_without_waiting_finds_a_prefix_in_three_calls(store):
    """exists() with no wait, called again after poll(): the head, then the
    rest of the prefix together, not one more key per call."""
    keys = [f"poll-{i}" for i in range(PAGES)]
    with engine(store, pages=PAGES) as reader, engine(store, pages=PAGES) as writer:
        # The index whole first: until then exists() waits for the answers (decision 110)
        assert reader.wait_scanned(30)
        data = random_pages(writer.geometry, PAGES, seed=10)
        fill(writer, range(PAGES), data)
        op = writer.backup(keys, range(PAGES))
        assert writer.wait(op, 60) and op.status == "ok", op
        got = []
        for _ in range(3):
            got.append(reader.exists(keys))
            deadline = time.monotonic() + 10
            while reader.metrics()["probes_sent"] > reader.metrics()["probes_found"] and \
                    time.monotonic() < deadline:   # every answer in: all asked keys exist
                reader.poll()
                time.sleep(0.01)
        assert got == [0, 1, PAGES], got
        assert reader.metrics()["probes_sent"] == PAGES


def test_an_answer_nobody_drained_is_not_taken_for_a_later_ask(store, monkeypatch):
    """An idle server polls nobody's rings: a probe's "missing" answer can sit
    undrained past ANSWER_LOST_S, when a new ask of that key no longer waits
    for it. Drained first, it is not taken for the new ask's answer, so the
    pages written meanwhile are found."""
    from hicache_mp.engine import discovery
    # 0.5 s, not 2 s, to sit out: still above PROBE_TTL_S, as the engine's is
    monkeypatch.setattr(discovery, "ANSWER_LOST_S", 0.5)
    keys = [f"idle-{i}" for i in range(8)]
    with engine(store, pages=8) as reader:
        assert reader.exists(keys) == 0            # its answer ("missing") is left undrained
        with engine(store, pages=8) as writer:
            fill(writer, range(8), random_pages(writer.geometry, 8, seed=11))
            op = writer.backup(keys, range(8))
            assert writer.wait(op, 60) and op.status == "ok", op
        time.sleep(discovery.ANSWER_LOST_S + 0.1)
        assert reader.exists(keys, wait_s=10.0) == 8


def test_exists_at_once_says_when_exists_would_wait(store):
    """`exists_at_once` (the SGLang fast path asks it before a hit query on the
    scheduler thread) gives a count exactly when exists() answers with no wait:
    every key indexed, or the store's answer for the first missing key (and,
    past a known head, for the misses after it) already in and fresh. Its
    verdicts are checked against exists() itself: where it gives a count,
    exists() answers at once whatever its wait_s, with the count a waiting
    call gives."""
    keys = [f"once-{i}" for i in range(8)]
    with engine(store, pages=8) as eng:
        assert eng.exists_at_once(keys) is None         # cold: the head must be asked
        fill(eng, range(4), random_pages(eng.geometry, 4, seed=12))
        op = eng.backup(keys[:4], range(4))
        assert eng.wait(op, 60) and op.status == "ok", op
        assert eng.exists_at_once(keys[:4]) is not None  # every key indexed
        assert eng.exists_at_once(keys) is None         # keys[4:] never asked about
        assert eng.exists(keys, wait_s=10.0) == 4      # asks them, and has the answers
        assert eng.exists_at_once(keys) is not None     # "missing", fresh: no wait now
        t0 = time.monotonic()
        assert eng.exists(keys, wait_s=10.0) == 4
        assert time.monotonic() - t0 < 1.0             # it did not wait its 10 s
        time.sleep(PROBE_TTL_S + 0.05)
        assert eng.exists_at_once(keys) is None         # stale: exists() would ask again
    assert eng.exists_at_once(keys[:4]) is None     # closed: never "at once"
