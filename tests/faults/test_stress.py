"""Eight threads on one engine, signals every few ms, a fork every second (issue 17).

Threads prefetch into overlapping slots, back pages up, cancel, and wait, while
a Python signal handler is hit every few milliseconds (on the waiting threads
themselves and on the process) and a child is forked every second, which must
find the engine refused and leave the parent's alone. Checked throughout: no
page ok with wrong bytes, no slot in two ops at once, no exception but the
documented ones (ValueError for a slot still in flight), every child refused,
no op left hanging; nothing left in /dev/shm (the autouse fixture).

Runs 6 s (the suite's share); HICACHE_MP_STRESS_S sets the length. Ends
with one `stress: ...` line.
"""
import json
import os
import random
import signal
import threading
import time

import numpy as np

from faultkit import content, fingerprint, get, make, put

from hicache_mp import EngineForked

THREADS = 8
SLOTS = 48          # shared by every thread: overlaps are the point
KEYS = 96


def duration_s() -> float:
    if os.environ.get("HICACHE_MP_STRESS_S"):
        return float(os.environ["HICACHE_MP_STRESS_S"])
    return 6.0  # as the soak's: a longer run is asked for, never the README's default


def test_stress_threads_signals_forks(store):
    seconds = duration_s()
    hits = [0]

    def handler(*_):
        hits[0] += 1

    old = signal.signal(signal.SIGUSR1, handler)
    e = make(store, pages=64, workers=2)
    try:
        keys = [f"s{i}" for i in range(KEYS)]
        page_bytes = e.geometry.page_bytes
        for i in range(0, KEYS, 32):
            for j, k in enumerate(keys[i:i + 32]):
                put(e, j, content(k, page_bytes))
            op = e.backup(keys[i:i + 32], range(32))
            assert e.wait(op, 60) and op.status == "ok"
        want = {k: fingerprint(content(k, page_bytes)) for k in keys}
        lock = threading.Lock()     # held around accepting an op and around checking bytes
        holder: dict[int, object] = {}
        n = dict(ops=0, backups=0, cancels=0, refused=0, two_ops=0, checked=0, wrong=0,
                 hung=0, forks=0, forks_refused=0, signals_sent=0)
        errors = []
        stop = time.monotonic() + seconds

        def accept(start, slots):
            """Start an op under the lock; None if a slot is still in flight."""
            with lock:
                try:
                    op = start()
                except ValueError as exc:
                    if "in flight" not in str(exc):
                        raise
                    n["refused"] += 1
                    return None
                n["two_ops"] += sum(1 for s in slots if s in holder and not holder[s].done)
                holder.update((s, op) for s in slots)
                return op

        def client(seed):
            rng = random.Random(seed)
            try:
                while time.monotonic() < stop:
                    slots = rng.sample(range(SLOTS), rng.randint(1, 8))
                    ks = rng.sample(keys, len(slots))
                    if rng.random() < 0.2:
                        def start():
                            if any(s in holder and not holder[s].done for s in slots):
                                raise ValueError("in flight (test's own check before filling)")
                            for s, k in zip(slots, ks):
                                put(e, s, content(k, page_bytes))
                            return e.backup(ks, slots)
                        op = accept(start, slots)
                        n["backups"] += op is not None
                    else:
                        op = accept(lambda: e.prefetch(ks, slots), slots)
                        if op is not None and rng.random() < 0.1:
                            e.cancel(op)
                            n["cancels"] += 1
                    if op is None:
                        continue
                    n["ops"] += 1
                    if not e.wait(op, 60):
                        n["hung"] += 1
                        continue
                    if op.kind != "read":
                        continue
                    with lock:
                        for pos in np.flatnonzero(op.page_status == 1).tolist():
                            slot = int(op.host_pages[pos])
                            if holder.get(slot) is op:
                                n["checked"] += 1
                                n["wrong"] += fingerprint(get(e, slot)) != want[op.keys[pos]]
            except BaseException as exc:
                errors.append(f"client {seed}: {exc!r}")

        def signaller(clients):
            rng = random.Random(99)
            while time.monotonic() < stop:
                target = rng.choice(clients)
                try:
                    if rng.random() < 0.5 and target.is_alive():
                        signal.pthread_kill(target.ident, signal.SIGUSR1)
                    else:
                        os.kill(os.getpid(), signal.SIGUSR1)
                    n["signals_sent"] += 1
                except ProcessLookupError:
                    pass
                time.sleep(rng.uniform(0.001, 0.005))

        def forker():
            while time.monotonic() < stop:
                time.sleep(1.0)
                pid = os.fork()
                if pid == 0:  # leaves only through os._exit: never back into pytest
                    code = 1
                    try:
                        try:
                            e.prefetch([keys[0]], [0])
                        except EngineForked:
                            try:
                                e.poll()
                            except EngineForked:
                                code = 0
                    finally:
                        os._exit(code)
                n["forks"] += 1
                _, status = os.waitpid(pid, 0)
                n["forks_refused"] += os.waitstatus_to_exitcode(status) == 0

        clients = [threading.Thread(target=client, args=(i,)) for i in range(THREADS)]
        helpers = [threading.Thread(target=signaller, args=(clients,)),
                   threading.Thread(target=forker)]
        for t in clients + helpers:
            t.start()
        for t in clients + helpers:
            t.join(seconds + 120)
        assert not any(t.is_alive() for t in clients + helpers), "a thread hung"
        m = e.metrics()
        print(f"\nstress: {seconds:g} s, {THREADS} threads, ops={n['ops']} "
              f"(backups={n['backups']} cancels={n['cancels']}) pages checked={n['checked']} "
              f"wrong bytes={n['wrong']} slot in two ops={n['two_ops']} "
              f"refused (slot in flight)={n['refused']} hung={n['hung']} "
              f"signals sent={n['signals_sent']} handled={hits[0]} forks={n['forks']} "
              f"refused in child={n['forks_refused']} other exceptions={len(errors)} "
              f"ops in flight at end={m['ops_in_flight']} respawns={m['respawns']}", flush=True)
        assert not errors, errors[:3]
        assert n["wrong"] == 0 and n["two_ops"] == 0 and n["hung"] == 0, json.dumps(n)
        # A fork a second is the aim; a loaded box forks a big process slower (54 of 60 seen).
        assert n["forks"] >= max(1, int(seconds) // 2) and n["forks_refused"] == n["forks"], n
        assert n["checked"] > 100 and hits[0] > 100, n
        assert m["ops_in_flight"] == 0 and m["respawns"] == 0, m
    finally:
        e.close()
        signal.signal(signal.SIGUSR1, old)
