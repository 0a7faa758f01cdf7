"""The physical floor of a busy scheduler loop: plain readers moving the same bytes at the same rate.

Owns `PacedReaders`: W reader processes, with no engine, no rings, no
semaphores and nothing the scheduler polls, that copy given byte ranges of
page files into memory of their own, paced so that the whole set takes a
given time (the time the engine took to move the same bytes). A busy loop
run beside them for that time measures what the machine alone costs it:
W processes copying tens of GB/s take memory bandwidth, caches and cores
whatever does the copying. The engine's own cost to the loop is then
loop(beside the engine) ÷ loop(beside these readers), both measured in one
run. Must not import the engine or poll anything; each caller runs its own
loop beside `start()`/`finish()`.

How a reader copies: `os.preadv` of each range into its row of an anonymous
shared mapping it touched first (as an engine worker's host-pool mapping is
populated at attach), one open/preadv/close per range as a worker's page
read is. Pace: range k of a reader's share starts no earlier than
start + k * seconds / len(share); a reader that falls behind reads flat out,
so its achieved GB/s is reported beside the asked one. Each round goes
start -> finish over the same processes (spawned once, so the first round
pays no interpreter start: the constructor returns once every reader has
touched its rows); `close()` ends them. Readers keep nothing on
disk or in /dev/shm.
"""
from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import time

PAGE = 4096


def _reader(conn, items, row_bytes: int, passes: int) -> None:
    """One reader: rounds of (start, seconds) in, (bytes, end) out, until None;
    a round reads its share `passes` times, into the same rows each time."""
    buf = mmap.mmap(-1, max(len(items), 1) * row_bytes)
    for off in range(0, len(buf), PAGE):   # touch: a populated mapping, as a worker's pool
        buf[off] = 0
    view = memoryview(buf)
    conn.send("ready")
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                return
            start, seconds = msg
            step = seconds / (len(items) * passes) if items else 0.0
            moved = 0
            for j in range(len(items) * passes):
                k = j % len(items)
                path, offset, length = items[k]
                wait = start + j * step - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                fd = os.open(path, os.O_RDONLY)
                try:
                    moved += os.preadv(fd, [view[k * row_bytes:k * row_bytes + length]], offset)
                finally:
                    os.close(fd)
            conn.send((moved, time.monotonic()))
    finally:
        view.release()
        buf.close()


class PacedReaders:
    """W reader processes over `items` [(path, file offset, length)], split
    round-robin; `row_bytes` >= every length (each range gets its own row); a
    round reads every range `passes` times (a bench that reads its store
    several times per measurement)."""

    def __init__(self, items: list, workers: int, row_bytes: int | None = None, passes: int = 1):
        if not items or workers < 1:
            raise ValueError("PacedReaders needs at least one range and one reader")
        self.items = list(items)
        self.nbytes = passes * sum(length for _, _, length in self.items)
        row = row_bytes or max(length for _, _, length in self.items)
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        try:
            for w in range(min(workers, len(self.items))):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_reader, args=(child, self.items[w::workers], row, passes),
                                daemon=True, name=f"hicache_mp-floor-{w}")
                p.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(p)
            for c in self._conns:   # started, imported and touched: a round's clock is theirs
                if not c.poll(120) or c.recv() != "ready":
                    raise RuntimeError("a floor reader did not start within 120 s")
        except BaseException:
            self.close()
            raise
        self._start = None

    @property
    def workers(self) -> int:
        return len(self._procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def start(self, seconds: float, lead_s: float = 0.05) -> float:
        """Begin a round that moves every range in `seconds`; the monotonic time it
        starts at (`lead_s` from now, so every reader has the message first)."""
        self._start = time.monotonic() + lead_s
        for c in self._conns:
            c.send((self._start, seconds))
        return self._start

    def finish(self, timeout_s: float = 600.0) -> dict:
        """Wait for the round: bytes moved, seconds from its start to the last
        reader's end, and the GB/s that makes."""
        moved, end = 0, self._start
        for c in self._conns:
            if not c.poll(timeout_s):
                raise TimeoutError(f"a floor reader did not finish within {timeout_s:g} s")
            b, t = c.recv()
            moved, end = moved + b, max(end, t)
        secs = end - self._start
        return {"bytes": moved, "seconds": secs, "gbps": moved / secs / 1e9 if secs > 0 else None,
                "workers": self.workers}

    def close(self) -> None:
        for c in self._conns:
            try:
                c.send(None)
            except OSError:
                pass
        for p in self._procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        for c in self._conns:
            c.close()
        self._conns, self._procs = [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
