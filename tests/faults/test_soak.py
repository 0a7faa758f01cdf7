"""Soak: random prefetch, backup and cancel, with random worker kills and
random file damage, for a bounded time (60 s; 15 s when CI=true;
HICACHE_SOAK_S overrides). Prints one summary line.

Bookkeeping, per key: every version ever submitted for it (a read may return
any of them: a killed or cancelled write may or may not have landed), and the
version it *must* hold when the last write was reported ok and nothing
damaged the file since. Checked all along and once more at the end:
- a page reported ok is byte-identical to some version written for its key;
- a key that must hold a version is never lost (read back as a miss);
- no op runs longer than a bound (nothing hangs);
- every killed worker is replaced.
A key is never read and written by two ops at once here (the sharing test
covers that race), so "must hold" is exact.
"""
import os
import random
import signal
import time

import numpy as np

from workers import status as st

from faultkit import content, fingerprint, get, make, page_file, put

KEYS = [f"soak-{i}" for i in range(160)]
SLOTS = 96
OP_BOUND_S = 20.0
GEO = dict(num_layers=4, num_kv_heads=4, head_dim=32, page_size=8)  # 16 KiB pages


def _duration() -> float:
    if os.environ.get("HICACHE_SOAK_S"):
        return float(os.environ["HICACHE_SOAK_S"])
    return 15.0 if os.environ.get("CI", "").lower() == "true" else 60.0


class Soak:
    def __init__(self, eng, rng):
        self.e, self.rng = eng, rng
        self.pb = eng.geometry.page_bytes
        self.versions = {k: set() for k in KEYS}     # fingerprints of every version submitted
        self.must = {k: None for k in KEYS}          # fingerprint the file must hold, if known
        self.next_version = 0
        self.busy_keys, self.free = set(), set(range(SLOTS))
        self.inflight = []                           # (op, fingerprints written or None)
        self.ops = self.kills = self.damage = self.checked = self.wrong = self.lost = 0
        self.damage_seen = 0

    # --- operations -----------------------------------------------------------
    def _pick(self, n):
        keys = [k for k in self.rng.sample(KEYS, min(len(KEYS), 3 * n)) if k not in self.busy_keys][:n]
        n = min(len(keys), len(self.free))
        return keys[:n], self.rng.sample(sorted(self.free), n)

    def backup(self):
        keys, slots = self._pick(self.rng.randint(1, 12))
        if not keys:
            return
        written = []
        for k, s in zip(keys, slots):
            self.next_version += 1
            data = content(k, self.pb, version=self.next_version)
            put(self.e, s, data)
            written.append(fingerprint(data))
            self.versions[k].add(written[-1])
        self._launch(self.e.backup(keys, slots), keys, slots, written)

    def prefetch(self):
        keys, slots = self._pick(self.rng.randint(1, 16))
        if keys:
            self._launch(self.e.prefetch(keys, slots), keys, slots, None)

    def _launch(self, op, keys, slots, written):
        self.busy_keys.update(keys)
        self.free.difference_update(slots)
        self.inflight.append((op, written, time.monotonic()))
        self.ops += 1

    def cancel(self):
        if self.inflight:
            self.e.cancel(self.rng.choice(self.inflight)[0])

    # --- faults ---------------------------------------------------------------
    def kill_worker(self):
        if self.e.metrics()["respawns"] < self.kills:  # the last victim is not replaced yet
            return
        ready = self.e._pool.usable()
        if not ready:
            return
        os.kill(self.rng.choice(ready).pid, signal.SIGKILL)
        self.kills += 1

    def damage_file(self):
        idle = [k for k in KEYS if k not in self.busy_keys and os.path.exists(page_file(self.e, k))]
        if not idle:
            return
        key = self.rng.choice(idle)
        path = page_file(self.e, key)
        size = os.path.getsize(path)
        how = self.rng.choice(("truncate", "flip", "append", "empty", "other_key"))
        if size == 0 and how in ("truncate", "flip"):  # damaged before: add a byte instead
            how = "append"
        if how == "truncate":
            os.truncate(path, self.rng.randrange(size))
        elif how == "flip":
            with open(path, "r+b") as f:
                at = self.rng.randrange(size)
                f.seek(at)
                b = f.read(1)
                f.seek(at)
                f.write(bytes([b[0] ^ (1 << self.rng.randrange(8))]))
        elif how == "append":
            with open(path, "ab") as f:
                f.write(b"\0")
        elif how == "empty":
            os.truncate(path, 0)
        else:
            other = self.rng.choice([k for k in idle if k != key] or [key])
            if other == key:
                return
            with open(page_file(self.e, other), "rb") as src, open(path, "wb") as dst:
                dst.write(src.read())
        self.must[key] = None
        self.damage += 1

    # --- completions ----------------------------------------------------------
    def reap(self):
        self.e.poll()
        still = []
        for op, written, t0 in self.inflight:
            if not op.done:
                assert time.monotonic() - t0 < OP_BOUND_S, f"op hung: {op} {op.status_counts()}"
                still.append((op, written, t0))
                continue
            self._account(op, written)
            self.busy_keys.difference_update(op.keys)
            self.free.update(op.host_pages.tolist())
        self.inflight = still

    def _account(self, op, written):
        for pos, code in enumerate(op.page_status.tolist()):
            key, slot = op.keys[pos], int(op.host_pages[pos])
            if written is not None:
                if code == st.OK:
                    self.must[key] = written[pos]
                elif code == st.WORKER_DIED:
                    self.must[key] = None  # it may have landed or not
            elif code == st.OK:
                self.checked += 1
                if fingerprint(get(self.e, slot)) not in self.versions[key]:
                    self.wrong += 1
            elif code in st.READ_MISSES:
                if self.must[key] is not None:
                    self.lost += 1
                if code in (st.CORRUPT, st.WRONG_KEY):
                    self.damage_seen += 1

    def drain(self):
        deadline = time.monotonic() + OP_BOUND_S
        while self.inflight:
            assert time.monotonic() < deadline, "ops hung at the end of the soak"
            self.reap()
            time.sleep(0.001)

    def final_check(self):
        """Read every key once more, with no faults running."""
        for at in range(0, len(KEYS), SLOTS):
            keys = KEYS[at:at + SLOTS]
            op = self.e.prefetch(keys, range(len(keys)))
            assert self.e.wait(op, OP_BOUND_S)
            self._account(op, None)
            for pos, key in enumerate(keys):
                if self.must[key] is not None:
                    assert op.page_status[pos] == st.OK, (key, st.NAMES[int(op.page_status[pos])])
                    assert fingerprint(get(self.e, pos)) == self.must[key], key


def test_soak(tmp_path, capsys):
    seed = int(os.environ.get("HICACHE_SOAK_SEED", time.time_ns() % 2**32))
    rng = random.Random(seed)
    depth = 1 + seed % 2  # the seed also picks inline workers or two lanes each
    print(f"soak seed {seed}")
    with make(str(tmp_path), geo=GEO, layout="layer_first", pages=SLOTS, workers=3,
              worker_batch=4, write_checksum=True, quarantine_bad_files=True,
              io_depth=depth) as e:
        soak = Soak(e, rng)
        end = time.monotonic() + _duration()
        while time.monotonic() < end:
            soak.reap()
            r = rng.random()
            if r < 0.40:
                soak.backup()
            elif r < 0.85:
                soak.prefetch()
            elif r < 0.92:
                soak.cancel()
            elif r < 0.94:
                soak.kill_worker()
            else:
                soak.damage_file()
            time.sleep(rng.random() * 0.004)
        soak.drain()
        respawned = settle_respawns(e, soak.kills)
        soak.final_check()
        survived = respawned + (soak.damage if soak.wrong == 0 and soak.lost == 0 else 0)
        line = (f"soak: ops={soak.ops} faults injected={soak.kills + soak.damage} "
                f"survived={survived} pages checked={soak.checked} wrong bytes={soak.wrong}")
        with capsys.disabled():
            print(f"\n{line} (seed {seed}, io_depth {depth}, {soak.kills} kills, {soak.damage} damaged files, "
                  f"{soak.damage_seen} read back as corrupt/wrong_key, lost={soak.lost})")
        assert soak.wrong == 0 and soak.lost == 0, line
        assert respawned == soak.kills, line
        assert soak.ops > 50 and soak.checked > 0, line
        assert np.all(np.asarray(e.metrics()["ring_depth"]) == 0)


def settle_respawns(e, want, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while e.metrics()["respawns"] < want and time.monotonic() < deadline:
        e.poll()
        time.sleep(0.01)
    return e.metrics()["respawns"]
