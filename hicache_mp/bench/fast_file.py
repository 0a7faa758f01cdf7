"""FastFileEngine: the `fast_file` baseline, a replica of SGLang PR #39880's I/O paths.

sgl-project/sglang PR #39880 adds `HiCacheFastFile` (mem_cache/storage/fast_file/
fast_file_store.py). This module moves pages the way it does, inside the
scheduler process on Python threads, so `mp` can be measured against it in one
run. What each part stands for:

- `_loop`: HiCacheController's prefetch threads (`prefetch_thread_func`, whose
  `_storage_hit_query` is `_hit_query` here, then `prefetch_io_aux_func`) and
  its backup thread; each op is cut into `STORAGE_BATCH_SIZE` (128) page
  batches (`_page_transfer`, `_page_backup`), the op is checked for
  termination before each batch, and a batch's pages complete together (one
  PrefetchAck per batch).
- `_transfer`: `HiCacheFastFile._transfer_pages` (`batch_get_v1` / `batch_set_v1`):
  one iovec list per page over the host pool's own memory (`_pool_page_buffers`)
  for the page-first layouts, a staged tensor copy otherwise (`_staged_read_page`).
- `_map_on`: the PR's `_map_on`: inline when a pool has one worker (`read_workers`
  and `write_workers`, default 1 each, separate pools), else one contiguous slice
  per worker submitted to a `ThreadPoolExecutor` and waited on in order.
- `_read_page`: `_read_page_buffers`: `os.open`, `os.fstat` size check,
  `os.readv` straight into the pool (`_readv_exact`), `os.close`.
- `_write_page`: `_write_page_buffers` + `_publish_page_locked`: a striped
  lock, `os.path.getsize` (an existing page of the right size is skipped), a
  temp file named with pid, thread id and uuid4 (in the store's temp-name form)
  opened O_EXCL, `os.writev`, `os.close`, `os.replace`.

The one difference is the file format: pages carry this project's 4096-byte
header (workers.pagefile) so all backends share one store; the header rides in
the same `readv`/`writev` as the payload and is checked in Python after the
read, so the system calls per page are the PR's. Without max_size the PR's
evictor and metadata cache are inert, so they are not replicated. Where the
replica departs from the PR it spares work, never adds it: per batch it takes
the pool's byte views directly (the PR lists every token index and builds a
ctypes buffer per page), and the controller's thread-to-thread hand-offs of
an op (hit query, I/O, progress sync) happen on one thread here.

Owns only those threads, as an I/O backend (FastFileIO, on
hicache_mp.engine.iobackend's protocol) under a plain EngineCore. Must not be used
as the production path.
"""
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch

from workers import pagefile, tmpfiles
from workers import status as st

from ..engine.core import EngineCore
from ..engine.iobackend import IOContext
from ..engine.ops import READ, Op
from .inprocess import InProcessThreads
from .storedir import write_page_file

STORAGE_BATCH_SIZE = 128          # sglang.srt.mem_cache.hicache_storage
DIRECT_IO_LAYOUTS = ("page_first", "page_first_direct")
WRITE_LOCK_STRIPES = 256


class _CorruptPage(OSError):
    pass


def FastFileEngine(config, geometry, *, read_workers: int = 1,
                   write_workers: int = 1) -> EngineCore:
    """The `fast_file` baseline: an EngineCore over FastFileIO."""
    for name, n in (("read_workers", read_workers), ("write_workers", write_workers)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"fast_file {name} must be an integer >= 1, got {n!r}")
    return EngineCore(config, geometry,
                      lambda ctx: FastFileIO(ctx, read_workers, write_workers))


class FastFileIO(InProcessThreads):
    name = "fast_file"

    def __init__(self, ctx: IOContext, read_workers: int, write_workers: int):
        super().__init__(ctx)
        geometry = ctx.geometry
        self.read_workers, self.write_workers = read_workers, write_workers
        self._direct = geometry.layout in DIRECT_IO_LAYOUTS
        self._dtype = getattr(torch, geometry.dtype)
        self._fp = geometry.fingerprint()
        self._iov_max = _iov_max()
        self._write_locks = tuple(threading.Lock() for _ in range(WRITE_LOCK_STRIPES))
        self._read_executor = ThreadPoolExecutor(read_workers, "hicache_mp-ffread") \
            if read_workers > 1 else None
        self._write_executor = ThreadPoolExecutor(write_workers, "hicache_mp-ffwrite") \
            if write_workers > 1 else None
        self._start_threads("fast_file")  # _done: (op, [pos], [code], io_ns per page, [errno])

    # --- the controller threads (prefetch_io_aux / backup) --------------------
    def _loop(self, kind: str) -> None:
        for op in self._queued(kind):
            todo = [pos for pos in range(op.num_pages) if op.page_status[pos] == st.PENDING]
            if kind == READ and todo and not (op.cancelled or self._stopping):
                todo = self._hit_query(op, todo)
            for i in range(0, len(todo), STORAGE_BATCH_SIZE):
                batch = todo[i:i + STORAGE_BATCH_SIZE]
                t0 = time.perf_counter_ns()
                if op.cancelled or self._stopping:
                    results = [(st.CANCELLED, 0)] * len(batch)
                else:
                    results = self._transfer(op, batch, kind == READ)
                per_page = (time.perf_counter_ns() - t0) // len(batch)
                self._done.append((op, batch, results, per_page))
                self._signal.set()

    def _hit_query(self, op: Op, todo: list) -> list:
        """The controller's `_storage_hit_query` before a prefetch is read: the
        PR's `batch_exists` (`_collect_existing_component_keys`: one
        `os.path.exists` per page, on the read pool) per 128-page batch, up to
        the first absent page. Pages past it are not read (SGLang truncates the
        op to its hits): they end CANCELLED, which leaves the index alone."""
        hits = 0
        for i in range(0, len(todo), STORAGE_BATCH_SIZE):
            paths = [self._path(op.digests[pos]) for pos in todo[i:i + STORAGE_BATCH_SIZE]]
            present = self._map_on(self._read_executor, self.read_workers, os.path.exists, paths)
            run = next((j for j, ok in enumerate(present) if not ok), len(present))
            hits += run
            if run < len(present):
                break
        if hits < len(todo):
            # The first absent page is still read, so it ends MISS and the index heals.
            rest = todo[hits + 1:]
            self._done.append((op, rest, [(st.CANCELLED, 0)] * len(rest), 0))
            self._signal.set()
            return todo[:hits + 1]
        return todo

    def _transfer(self, op: Op, batch: list, read: bool) -> list:
        digests = [op.digests[pos] for pos in batch]
        slots = [int(op.host_pages[pos]) for pos in batch]
        if self._direct:
            buffers = [self.host_pool.page_iovecs(s) for s in slots]
            if read:
                return self._map_on(self._read_executor, self.read_workers,
                                    self._read_page, digests, buffers)
            return self._map_on(self._write_executor, self.write_workers,
                                self._write_page, digests, buffers)
        if read:
            return self._map_on(self._read_executor, self.read_workers,
                                self._staged_read, digests, slots)
        return self._map_on(self._write_executor, self.write_workers,
                            self._staged_write, digests, slots)

    @staticmethod
    def _map_on(executor, workers: int, fn, *iterables) -> list:
        calls = list(zip(*iterables))
        if executor is None or len(calls) <= 1:
            return [fn(*args) for args in calls]
        # One contiguous slice per worker, not one task per page (the PR's hand-off).
        step = -(-len(calls) // workers)
        futures = [executor.submit(lambda chunk: [fn(*args) for args in chunk], calls[i:i + step])
                   for i in range(0, len(calls), step)]
        results = []
        for f in futures:
            results.extend(f.result())
        return results

    # --- one page ---------------------------------------------------------------
    def _path(self, digest: bytes) -> str:
        return self._store.path(digest)

    def _read_page(self, digest: bytes, buffers: list) -> tuple[int, int]:
        header = memoryview(bytearray(pagefile.HEADER_SIZE))
        buffers = [header] + buffers
        expected = sum(len(b) for b in buffers)
        try:
            fd = os.open(self._path(digest), os.O_RDONLY)
            try:
                if os.fstat(fd).st_size != expected:
                    raise _CorruptPage
                self._readv_exact(fd, buffers)
            finally:
                os.close(fd)
        except FileNotFoundError:
            return st.MISS, 0
        except _CorruptPage:
            return st.CORRUPT, 0
        except OSError as exc:
            return st.UNREADABLE, exc.errno or 0
        return pagefile.check_header(header, self.geometry.page_bytes, self._fp, digest)[0], 0

    def _readv_exact(self, fd: int, buffers: list) -> None:
        pending = [b for b in buffers if len(b)]
        expected = sum(len(b) for b in pending)
        completed = 0
        while pending:
            n = os.readv(fd, pending[:self._iov_max])
            if n == 0:
                break
            completed += n
            _consume(pending, n)
        if completed != expected:
            raise _CorruptPage

    def _write_page(self, digest: bytes, buffers: list) -> tuple[int, int]:
        path = self._path(digest)
        header = pagefile.build_header(self.geometry.page_bytes, self._fp, digest)
        buffers = [memoryview(header)] + buffers
        size = sum(len(b) for b in buffers)
        with self._write_locks[hash(digest) % WRITE_LOCK_STRIPES]:
            try:
                if os.path.getsize(path) == size:
                    return st.OK, 0   # already there: the PR skips it
            except FileNotFoundError:
                pass
            except OSError as exc:
                return st.IOERROR, exc.errno or 0
            # The store's temp form (so its stale-temp scan knows it), the PR's uniquifier.
            tmp = tmpfiles.tmp_name(path, f"{threading.get_ident()}-{uuid.uuid4().hex}")

            def write(tmp: str) -> None:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    self._writev_exact(fd, buffers)
                finally:
                    os.close(fd)

            return write_page_file(path, tmp, write)  # in fan-out dirs (PR: one flat dir)

    def _writev_exact(self, fd: int, buffers: list) -> None:
        pending = [b for b in buffers if len(b)]
        while pending:
            n = os.writev(fd, pending[:self._iov_max])
            if n == 0:
                raise OSError("short write")
            _consume(pending, n)

    # Layouts without direct I/O: read into a page tensor, then copy it in.
    def _staged_read(self, digest: bytes, slot: int) -> tuple[int, int]:
        target = torch.empty(self.geometry.page_bytes // self.geometry.itemsize, dtype=self._dtype)
        code, err = self._read_page(digest, [memoryview(target.view(torch.uint8).numpy())])
        if code == st.OK:
            self.host_pool.page_view(slot).copy_(target.view(self.geometry.page_shape))
        return code, err

    def _staged_write(self, digest: bytes, slot: int) -> tuple[int, int]:
        flat = self.host_pool.page_view(slot).contiguous()
        return self._write_page(digest, [memoryview(flat.view(-1).view(torch.uint8).numpy())])

    # --- the protocol (hicache_mp.engine.iobackend) --------------------------------------
    def submit(self, op: Op) -> None:
        self._queues[op.kind].put(op)

    def quiet(self) -> bool:  # poll() always drains the completion deque
        return False

    def drain(self, lazy: bool = False) -> int:  # in-process: nothing to be lazy about
        n = 0
        while self._done:
            op, batch, results, io_ns = self._done.popleft()
            now = time.perf_counter_ns()
            for pos, (code, err) in zip(batch, results):
                self._ledger.apply(op, pos, code, io_ns, err, now)
            n += len(batch)
        return n

    def _stop_helpers(self) -> None:
        for ex in (self._read_executor, self._write_executor):
            if ex is not None:
                ex.shutdown(wait=True)

    def num_workers(self) -> int:
        return self.read_workers

    def metrics(self, now_ns: int) -> dict:
        return {"read_workers": self.read_workers, "write_workers": self.write_workers}


def _consume(buffers: list, n: int) -> None:
    while buffers and n >= len(buffers[0]):
        n -= len(buffers[0])
        buffers.pop(0)
    if n:
        buffers[0] = buffers[0][n:]


def _iov_max() -> int:
    try:
        return max(1, int(os.sysconf("SC_IOV_MAX")))
    except (AttributeError, OSError, ValueError):
        return 1024
