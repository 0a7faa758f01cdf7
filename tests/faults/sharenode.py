"""One "node" of the sharing test: an engine in its own process on a shared store.

Kept in its own module so `multiprocessing` (spawn) can import it in the
child. Each node backs up its keys round after round while prefetching the
other node's keys, and reports what it saw: every page read must be a miss or
byte-identical to what some writer wrote for that key in some round.
"""
import time
import traceback

from faultkit import MID, content, fingerprint, make, prefetch, put, wrong_pages

# Eight rounds, with CI or without (each node still reads the other's
# overlapping keys while they are rewritten, 16 of them in every round)
ROUNDS = 8
KEYS = [f"shared-{i}" for i in range(48)]
RANGES = {0: (0, 32), 1: (16, 48)}  # keys 16..31 are written by both nodes
WRITERS = {k: [w for w, (lo, hi) in RANGES.items() if lo <= i < hi] for i, k in enumerate(KEYS)}


def keys_of(node: int) -> list:
    lo, hi = RANGES[node]
    return KEYS[lo:hi]


def run(store: str, me: int, layout: str, rescan_s: float, barrier, out) -> None:
    try:
        out.put(_run(store, me, layout, rescan_s, barrier))
    except BaseException:
        out.put({"error": traceback.format_exc()})


def _run(store, me, layout, rescan_s, barrier) -> dict:
    mine, theirs = keys_of(me), keys_of(1 - me)
    exclusive = [k for k in theirs if k not in mine]
    report = {"node": me, "read_ok": 0, "read_miss": 0, "torn": 0, "wrong": 0,
              "write_ok": 0, "write_failed": 0}
    with make(store, geo=MID, layout=layout, pages=64, workers=2, rescan_interval_s=rescan_s) as e:
        pb = e.geometry.page_bytes
        any_round = lambda k: {fingerprint(content(k, pb, w, r))  # noqa: E731
                               for w in WRITERS[k] for r in range(ROUNDS)}
        barrier.wait(60)  # both engines up: start together
        for r in range(ROUNDS):
            for i, k in enumerate(mine):
                put(e, i, content(k, pb, me, r))
            read = e.prefetch(theirs, range(32, 64))   # races the other node's renames
            write = e.backup(mine, range(32))
            assert e.wait(write, 60) and e.wait(read, 60)
            counts = read.status_counts()
            report["read_ok"] += counts.get("ok", 0)
            report["read_miss"] += counts.get("miss", 0)
            # With temp file + rename a reader sees the old page, the new one or
            # none: never a half-written file (which would read as corrupt).
            report["torn"] += sum(n for c, n in counts.items() if c not in ("ok", "miss"))
            for c, n in counts.items():  # which statuses, for the failure's message
                if c not in ("ok", "miss"):
                    report.setdefault("torn_by_status", {})[c] = \
                        report.get("torn_by_status", {}).get(c, 0) + n
            report["wrong"] += len(wrong_pages(e, read, any_round))
            report["write_ok"] += write.ok_pages
            report["write_failed"] += write.num_pages - write.ok_pages
        barrier.wait(60)  # both done writing
        report["known_before"] = e.exists(exclusive)
        if rescan_s:
            # No refresh() call: poll() alone must pick the other's pages up.
            report["picked_up"] = _poll_until(e, lambda: e.exists(theirs) == len(theirs))
        else:
            e.refresh()
            report["picked_up"] = e.exists(theirs) == len(theirs)
        last = lambda k: {fingerprint(content(k, pb, w, ROUNDS - 1)) for w in WRITERS[k]}  # noqa: E731
        final = prefetch(e, theirs, range(32, 64))
        deadline = time.monotonic() + 5
        while final.status_counts().get("miss") and time.monotonic() < deadline:
            # On a network filesystem this node's kernel may map a name to the inode
            # the other node's last rename replaced, for its entry-cache time (JuiceFS:
            # 1 s): clean misses, then the new page (tests/scaleout).
            time.sleep(0.2)
            final = prefetch(e, theirs, range(32, 64))
        report["final"] = final.status_counts()
        report["final_wrong"] = len(wrong_pages(e, final, last))
        barrier.wait(60)  # neither closes (and rescans) while the other still reads
    return report


def _poll_until(e, check, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        e.poll()
        if check():
            return True
        time.sleep(0.02)
    return False
