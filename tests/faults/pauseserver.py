"""A stand-in server for the whole-server pause test: an engine that backs up
new pages and prefetches acknowledged ones, round after round, until a stop
file appears; then it reads every acknowledged page back and reports.

Run as ``python pauseserver.py <store> <stop file> <stall_timeout_s>`` (the
test puts it in a process group of its own, its workers with it). Prints one
line ``READY <control segment>`` once the engine is up and a first round is
done (the test watches the workers' heartbeats there), then, at the
end, ``RESULT <json>``: rounds, page statuses, pages reported ok with wrong
bytes, waits that timed out, acknowledged pages not read back whole,
metrics' stuck_workers and stalled_pages.

Reaches inside: the engine's `_control` (the control segment's name, printed
so the test can map it and watch the workers' heartbeats from outside while
the whole server is paused; no public call names the segment).
"""
import functools
import json
import os
import random
import sys

from faultkit import BIG, MID, content, fingerprint, make, poison, put, wrong_pages

PER_OP = 8
WAIT_S = 60.0


def main(store: str, stop: str, stall_s: float) -> dict:
    out = {"rounds": 0, "statuses": {}, "wrong": 0, "hung": 0, "lost": 0}
    acked: list[str] = []
    rng = random.Random(1)
    with make(store, geo=BIG, pages=2 * PER_OP, workers=2, stall_timeout_s=stall_s) as e:
        pb = e.geometry.page_bytes
        # Remembered: making 2 MiB of page bytes costs more than its I/O, and the
        # pause should find the workers busy, not the loop.
        data = functools.lru_cache(maxsize=None)(lambda k: content(k, pb))
        allowed = functools.lru_cache(maxsize=None)(lambda k: {fingerprint(data(k))})

        def settle(op):
            if not e.wait(op, WAIT_S):
                out["hung"] += 1
                e.abandon(op)
            for s, c in op.status_counts().items():
                out["statuses"][s] = out["statuses"].get(s, 0) + c
            if op.kind != "write":
                out["wrong"] += len(wrong_pages(e, op, allowed))

        def unfenced():
            while e.metrics()["fenced_pages"]:  # a killed worker's slots, until it is reaped
                e.poll()

        while not os.path.exists(stop):
            n = out["rounds"]
            out["rounds"] += 1
            unfenced()
            keys = [f"r{n}-{j}" for j in range(PER_OP)]
            for j, k in enumerate(keys):
                put(e, j, data(k))
            wop = e.backup(keys, range(PER_OP))
            rkeys = rng.sample(acked, min(PER_OP, len(acked)))
            poison(e, range(PER_OP, PER_OP + len(rkeys)))
            rop = e.prefetch(rkeys, range(PER_OP, PER_OP + len(rkeys)))
            settle(wop)
            settle(rop)
            acked += [k for k, s in zip(keys, wop.page_status.tolist()) if s == 1]  # status.OK
            if n == 0:
                print("READY " + e._control.name, flush=True)
        unfenced()
        for i in range(0, len(acked), PER_OP):
            keys = acked[i:i + PER_OP]
            slots = range(PER_OP, PER_OP + len(keys))
            poison(e, slots)
            op = e.prefetch(keys, slots)
            if not e.wait(op, WAIT_S):
                out["hung"] += 1
            out["lost"] += int((op.page_status != 1).sum())
            out["wrong"] += len(wrong_pages(e, op, allowed))
        m = e.metrics()
        out.update(acked=len(acked), stuck_workers=m["stuck_workers"],
                   stalled_pages=m["stalled_pages"])
    return out


if __name__ == "__main__":
    result = main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
    print("RESULT " + json.dumps(result), flush=True)
