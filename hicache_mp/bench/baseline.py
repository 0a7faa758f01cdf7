"""ThreadedFileEngine: the `file` baseline, reading on a Python thread in-process.

It reproduces how SGLang's HiCacheFile backend moves pages, so the two can be
compared in one run: for each page the hit query's `os.path.isfile`, a
temporary tensor, an `open`, `readinto` into that tensor, then a copy into
the host pool; writes copy the page out
and write it. The I/O runs on Python threads inside the scheduler process, so
every step needs the GIL, which a busy scheduler loop rarely lets go. Same
API, same file format and same host pool as `PrefetchEngine`.

Owns only that thread's loop, as an I/O backend (ThreadedFileIO, on
hicache_mp.engine.iobackend's protocol) under a plain EngineCore. Must not be used
as the production path.
"""
import os
import time

import torch

from workers import pagefile, tmpfiles
from workers import status as st

from ..engine.core import EngineCore
from ..engine.iobackend import IOContext
from ..engine.ops import READ, Op
from .inprocess import InProcessThreads
from .storedir import write_page_file


def ThreadedFileEngine(config, geometry) -> EngineCore:
    """The `file` baseline: an EngineCore over ThreadedFileIO."""
    return EngineCore(config, geometry, ThreadedFileIO)


class ThreadedFileIO(InProcessThreads):
    name = "file"

    def __init__(self, ctx: IOContext):
        super().__init__(ctx)
        geometry = ctx.geometry
        self._dtype = getattr(torch, geometry.dtype)
        self._numel = geometry.page_bytes // geometry.itemsize
        self._fp = geometry.fingerprint()
        self._serial = 0
        self._start_threads("file")  # _done: (op, pos, status, io_ns, errno) from the threads

    # --- the I/O threads ------------------------------------------------------
    def _loop(self, kind: str) -> None:
        for op, pos in self._queued(kind):
            t0 = time.perf_counter_ns()
            if op.cancelled or self._stopping:
                code, err = st.CANCELLED, 0
            elif kind == READ:
                code, err = self._read(op, pos)
            else:
                code, err = self._write(op, pos)
            self._done.append((op, pos, code, time.perf_counter_ns() - t0, err))
            self._signal.set()

    def _read(self, op: Op, pos: int) -> tuple[int, int]:
        path = self._store.path(op.digests[pos])
        # SGLang's hit query (`_storage_hit_query` -> HiCacheFile.batch_exists: one
        # os.path.isfile per page) runs before the read; here on the same thread.
        if not os.path.isfile(path):
            return st.MISS, 0
        tmp = torch.empty(self._numel, dtype=self._dtype)   # per page, as SGLang's file backend
        try:
            with open(path, "rb", buffering=0) as f:
                header = f.read(pagefile.HEADER_SIZE)
                code, _ = pagefile.check_header(header, self.geometry.page_bytes, self._fp, op.digests[pos])
                if code != st.OK:
                    return code, 0
                n = f.readinto(memoryview(tmp.view(torch.uint8).numpy()))
                if n != self.geometry.page_bytes or f.read(1):
                    return st.CORRUPT, 0
        except FileNotFoundError:
            return st.MISS, 0
        except OSError as exc:
            return st.UNREADABLE, exc.errno or 0
        self.host_pool.page_view(int(op.host_pages[pos])).copy_(tmp.view(self.geometry.page_shape))
        return st.OK, 0

    def _write(self, op: Op, pos: int) -> tuple[int, int]:
        path = self._store.path(op.digests[pos])
        flat = self.host_pool.page_view(int(op.host_pages[pos])).contiguous()  # a copy, as SGLang
        self._serial += 1

        def write(tmp: str) -> None:
            with open(tmp, "wb") as f:
                f.write(pagefile.build_header(self.geometry.page_bytes, self._fp, op.digests[pos]))
                f.write(memoryview(flat.view(-1).view(torch.uint8).numpy()))

        return write_page_file(path, tmpfiles.tmp_name(path, self._serial), write)

    # --- the protocol (hicache_mp.engine.iobackend) ------------------------------------
    def submit(self, op: Op) -> None:
        q = self._queues[op.kind]
        for pos in range(op.num_pages):
            if op.page_status[pos] == st.PENDING:  # not dropped over the backup budget
                q.put((op, pos))

    def quiet(self) -> bool:  # poll() always drains the completion deque
        return False

    def drain(self, lazy: bool = False) -> int:  # in-process: nothing to be lazy about
        n = 0
        while self._done:
            op, pos, code, io_ns, err = self._done.popleft()
            self._ledger.apply(op, pos, code, io_ns, err, time.perf_counter_ns())
            n += 1
        return n
