"""The HiCache storage fast path's methods, as they read in SGLang's patched source.

One source for both ways the fast path ships: `fastpath.install()` puts these
functions on SGLang 0.5.23's `HiCacheController` and `HybridCacheController`
in a running process (rebound to the globals of SGLang's own module, so every
name in them resolves as it would in SGLang's file), and
`fastpath.patched_source()` writes them into SGLang's files in place of the
methods of the same name, which is how the upstream patch
(upstream/sglang-0.5.23-hicache-fastpath.patch) is made and checked.

What changes, and why (docs/sglang-fastpath.md has the hand-off table):
the I/O thread reduces each prefetch ack across ranks itself and puts it
straight on `ack_prefetch_queue` (`_publish_prefetch_ack`), so no ack waits
for `prefetch_sync_thread` to wake from `prefetch_sync_queue`: under a
scheduler loop that holds the GIL, each such wake cost up to a switch
interval per batch. The thread is left to exit at once. With no rank to
agree with (no sync group), the hit count and the completed tokens are
taken as they are, with no tensor; with ranks, the same MIN all-reduces
run, in the same order, on the same groups.

The hit query of a request runs on the scheduler thread, in `prefetch()`
(`_submit_hit_query`), when that cannot wait: one rank (no collective), no
query queued before it, and a backend that says it answers these keys
without I/O (`HiCacheStorage.hit_query_at_once`, False by default). Its hit
is then on `prefetch_hit_queue` for the scheduler's next drain, with no
prefetch-thread wake-up in between; otherwise the prefetch thread answers
it, as before. A one-batch request so costs SGLang one wake-up (the I/O
thread's, once its host slots are allocated) instead of two.

The queues through which the scheduler thread wakes a storage thread (a
prefetch's hit query, its transfer, a backup) are `HandoffQueue`s: put()
waits, GIL released, until the blocked consumer has taken the item, so the
consumer does not wait for a busy scheduler's switch interval.

Must not import hicache_mp, nor SGLang at module level: the text below is
SGLang's (it goes into the upstream patch verbatim) and resolves its names in
SGLang's module.
The holder classes are never instantiated; a method that calls `super()` is
given the target class's `__class__` cell at install.
"""
# ruff: noqa: F821  (names resolve in SGLang's module, whose globals these run under)
from __future__ import annotations  # as in both SGLang modules: annotations stay text

import threading
from queue import Queue  # as cache_controller.py imports both: HandoffQueue reads the same there


class HandoffQueue(Queue):
    """A Queue whose put() hands the GIL to a consumer thread blocked in get().

    A storage thread woken by the scheduler thread needs the GIL back, and a
    busy scheduler keeps it until the interpreter's switch interval (5 ms by
    default) forces a switch: each hand-off of a prefetch or backup cost up
    to that much. Here put() waits, with the GIL released, until the waiting
    consumer has taken the item (at most `handoff_wait_s`), so the consumer
    runs at once and the producer pays the consumer's wake-up instead (about
    0.1 ms). A consumer that is busy takes the item on its next get() with
    no wait, and put() does not wait for it.
    """

    handoff_wait_s = 0.002

    def __init__(self, maxsize: int = 0):
        super().__init__(maxsize)
        self.consumers_waiting = 0
        self.taken = threading.Condition(threading.Lock())
        self.taken_count = 0

    def get(self, block=True, timeout=None):
        if not block:
            return super().get(False)
        with self.mutex:
            self.consumers_waiting += 1
        try:
            item = super().get(True, timeout)
        finally:
            with self.mutex:
                self.consumers_waiting -= 1
        with self.taken:
            self.taken_count += 1
            self.taken.notify_all()
        return item

    def put(self, item, block=True, timeout=None):
        hand_off = self.consumers_waiting > 0
        with self.taken:
            taken = self.taken_count
        super().put(item, block, timeout)
        if hand_off:
            with self.taken:
                self.taken.wait_for(lambda: self.taken_count != taken, self.handoff_wait_s)


class StorageSwitchInterval:
    """While a storage thread has a prefetch in hand, the interpreter's switch
    interval is at most `interval_s`; a context manager, shared by every
    controller of the process (the interval is the process's).

    The fast path leaves one return to the GIL per backend wait: the wait
    ends (pages read, a semaphore posted) and the storage thread needs the
    GIL back from a scheduler loop that runs Python without pause. CPython
    gives it only once the waiter has waited a switch interval (5 ms by
    default), then asks the holder to drop it. That is 5 ms per batch, which
    no backend can avoid from behind batch_get. With 0.5 ms while a prefetch
    is in hand, the same return costs 0.5 ms. Outside that span the
    interval is the process's own, so a scheduler with no storage work in
    flight switches no more often than before; inside it, a switch happens
    only when another thread wants the GIL, and those are the storage
    threads whose wait is the request's latency.

    The span is the whole of an operation's work on its thread, not only
    the backend call: a waiter reads the interval when it starts waiting,
    so the scheduler, made to drop the GIL, would otherwise take it back
    after 0.5 ms and leave the storage thread to wait 5 ms again on its
    next bytecode. A value the user set lower is kept; one changed while a
    span is open is left as they set it.
    """

    interval_s = 0.0005
    lock = threading.Lock()
    inside = 0
    saved = None
    ours = None  # the interval as read back once set (CPython keeps whole microseconds)

    def __enter__(self):
        import sys

        cls = StorageSwitchInterval
        with cls.lock:
            if cls.inside == 0:
                cls.saved = sys.getswitchinterval()
                if cls.saved > cls.interval_s:
                    sys.setswitchinterval(cls.interval_s)
                    cls.ours = sys.getswitchinterval()
            cls.inside += 1
        return self

    def __exit__(self, *exc):
        import sys

        cls = StorageSwitchInterval
        with cls.lock:
            cls.inside -= 1
            if cls.inside == 0:
                if cls.ours is not None and sys.getswitchinterval() == cls.ours:
                    sys.setswitchinterval(cls.saved)
                cls.saved = cls.ours = None
        return False


class HiCacheStorageMethods:
    """Methods of sglang.srt.mem_cache.hicache_storage.HiCacheStorage."""

    def hit_query_at_once(
        self, keys: List[str], pool_transfers: Optional[list] = None
    ) -> bool:
        """
        Whether batch_exists (batch_exists_v2 with `pool_transfers`) on `keys`
        answers without waiting on I/O, e.g. from an in-memory index. If so,
        the cache controller may run the hit query on the scheduler thread and
        spare its prefetch thread a wake-up per request. A backend whose query
        is a disk or network round trip must answer False, the default.
        """
        return False


class HiCacheControllerMethods:
    """Methods of sglang.srt.managers.cache_controller.HiCacheController."""

    def _start_storage_threads(self):
        """Start storage prefetch/backup threads and their queues.

        This is used by runtime attach, and also by reset when storage is enabled.
        The queues the scheduler thread hands work to a storage thread through
        are HandoffQueues: the woken thread gets the GIL at once.
        """
        assert self.enable_storage
        assert not self.storage_stop_event.is_set()

        self.prefetch_thread = threading.Thread(
            target=self.prefetch_thread_func, daemon=True
        )
        self.prefetch_io_aux_thread = threading.Thread(
            target=self.prefetch_io_aux_func, daemon=True
        )
        self.prefetch_sync_thread = threading.Thread(
            target=self.prefetch_sync_thread_func, daemon=True
        )
        self.backup_thread = threading.Thread(
            target=self.backup_thread_func, daemon=True
        )
        self.prefetch_queue = HandoffQueue()
        self.backup_queue = HandoffQueue()
        self.prefetch_buffer = HandoffQueue()
        self.prefetch_sync_queue = Queue()
        self.prefetch_hit_queue = Queue()
        self.ack_prefetch_queue = Queue()
        self.ack_backup_queue = Queue()
        self.host_mem_release_queue = Queue()

        self.prefetch_thread.start()
        self.prefetch_io_aux_thread.start()
        self.prefetch_sync_thread.start()
        self.backup_thread.start()

    def prefetch(
        self,
        request_id: str,
        new_input_tokens: List[int],
        last_hash: Optional[str] = None,
        prefix_keys: Optional[List[str]] = None,
    ) -> PrefetchOperation:
        """
        Prefetch KV caches from storage backend to host memory.
        """
        operation = PrefetchOperation(
            request_id, new_input_tokens, last_hash, prefix_keys
        )
        self._submit_hit_query(operation)
        return operation

    def _submit_hit_query(self, operation: PrefetchOperation) -> None:
        """Answer `operation`'s hit query here, on the scheduler thread, when
        that cannot wait: one rank (no collective to make), no query queued
        before it (hits keep their order) and a backend that answers these
        keys without I/O (`hit_query_at_once`). Else the prefetch thread
        answers it, as before. Under a busy scheduler that thread's wake-up
        cost up to a GIL switch interval per request."""
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

        # A backend that keeps the default never answers at once: its pages are
        # hashed on the prefetch thread, as before, not on this one.
        overridden = getattr(
            type(self.storage_backend), "hit_query_at_once", None
        ) not in (None, HiCacheStorage.hit_query_at_once)
        if (
            overridden
            and not self.prefetch_hits_sync_groups
            and self.prefetch_queue.unfinished_tasks == 0
            and not operation.is_terminated()
        ):
            try:
                operation.all_hash_values = get_storage_hash_str(
                    operation.token_ids, operation.last_hash, page_size=self.page_size
                )
                at_once = self.storage_backend.hit_query_at_once(
                    operation.all_hash_values,
                    getattr(operation, "pool_transfers", None),
                )
            except Exception:
                at_once = False  # the prefetch thread queries and reports it
            if at_once:
                self._answer_hit_query(operation)
                return
        self.prefetch_queue.put(operation)

    def _answer_hit_query(self, operation: PrefetchOperation) -> None:
        """Query storage for `operation`'s hit, agree on it across ranks and
        hand it to the scheduler thread's drain (prefetch_hit_queue)."""
        try:
            if operation.is_terminated():
                hash_value, storage_hit_count = [], 0
            else:
                hash_value, storage_hit_count = self._storage_hit_query(operation)
        except Exception:
            logger.exception(
                "HiCache storage query failed for request %s",
                operation.request_id,
            )
            hash_value, storage_hit_count = [], 0

        storage_hit_count = self._sync_prefetch_hit_query(operation, storage_hit_count)

        # Record the TP-synced hit count; the scheduler thread decides
        # at drain time whether to revoke (below threshold) or allocate.
        operation.hash_value = hash_value[: (storage_hit_count // self.page_size)]
        operation.storage_hit_count = storage_hit_count
        self.prefetch_hit_queue.put(operation)

    def _storage_hit_query(self, operation) -> tuple[list[str], int]:
        last_hash = operation.last_hash
        tokens_to_fetch = operation.token_ids
        prefix_keys = operation.prefix_keys

        storage_query_count = 0
        hash_value = []
        page_hashes = operation.all_hash_values
        if page_hashes is None:  # _submit_hit_query may have hashed them already
            page_hashes = get_storage_hash_str(
                tokens_to_fetch, last_hash, page_size=self.page_size
            )
        operation.all_hash_values = page_hashes

        for start in range(0, len(page_hashes), STORAGE_BATCH_SIZE):
            batch_hashes = page_hashes[start : start + STORAGE_BATCH_SIZE]
            extra_info = HiCacheStorageExtraInfo(prefix_keys=prefix_keys)
            hit_page_num = self.storage_backend.batch_exists(batch_hashes, extra_info)
            hash_value.extend(batch_hashes[:hit_page_num])
            storage_query_count += hit_page_num * self.page_size
            if hit_page_num < len(batch_hashes):
                break
            if prefix_keys is not None:
                prefix_keys = prefix_keys + batch_hashes

        return hash_value, storage_query_count

    def prefetch_thread_func(self):
        """
        Manage prefetching operations from storage backend to host memory.
        """
        while (not self.storage_stop_event.is_set()) or not self.prefetch_queue.empty():
            try:
                operation = self.prefetch_queue.get(block=True, timeout=1)
            except Empty:
                continue
            try:
                if operation is not None:
                    with StorageSwitchInterval():
                        self._answer_hit_query(operation)
            finally:
                # _submit_hit_query answers inline only when nothing is left here.
                self.prefetch_queue.task_done()

    def _publish_prefetch_ack(self, ack: PrefetchAck) -> None:
        """Agree on `ack` across ranks and hand it to the scheduler thread.

        Runs on the I/O thread, in the order the acks are made, so every rank
        makes the same collectives in the same order without a thread hop
        (each hop cost a GIL hand-off per batch under a busy scheduler)."""
        self._reduce_prefetch_ack(ack)
        self.ack_prefetch_queue.put(ack)

    def _page_transfer(self, operation: PrefetchOperation) -> int:
        # Transfer batch by batch
        prefix_keys = operation.prefix_keys
        kv_derived_transfers = [
            transfer
            for transfer in getattr(operation, "pool_transfers", None) or []
            if transfer.indices_from_pool == PoolName.KV
        ]
        all_success = True
        completed_pages = 0
        for i in range(0, len(operation.hash_value), STORAGE_BATCH_SIZE):
            # When an error is occurred, we should keep looping and produce the same number of
            # PrefetchAck as other ranks do, because _publish_prefetch_ack performs a reduce
            # on the results.  This is so tricky.
            if all_success and operation.is_terminated():
                all_success = False
            if all_success:
                batch_hashes = operation.hash_value[i : i + STORAGE_BATCH_SIZE]
                batch_host_indices = operation.host_indices[
                    i * self.page_size : (i + len(batch_hashes)) * self.page_size
                ]

                # Get one batch token, and update the completed_tokens if succeed
                extra_info = HiCacheStorageExtraInfo(prefix_keys=prefix_keys)

                try:
                    hit_pages = self._page_transfer_kv_batch(
                        operation,
                        batch_hashes,
                        batch_host_indices,
                        extra_info,
                        kv_derived_transfers,
                    )
                except Exception:
                    logger.exception(
                        "HiCache prefetch transfer failed for request %s",
                        operation.request_id,
                    )
                    hit_pages = 0
                # Check termination
                if hit_pages != len(batch_hashes):
                    all_success = False
                if prefix_keys is not None:
                    prefix_keys = prefix_keys + batch_hashes
                completed_pages += hit_pages
            ack = PrefetchAck(
                rid=operation.request_id,
                completed_tokens=completed_pages * self.page_size,
                operation=operation,
            )
            self._publish_prefetch_ack(ack)
        return completed_pages

    def prefetch_io_aux_func(self):
        """
        Auxiliary function conducting IO operations for prefetching.
        """
        while not self.storage_stop_event.is_set():
            try:
                operation = self.prefetch_buffer.get(block=True, timeout=1)
            except Empty:
                continue
            if operation is None:
                continue
            with StorageSwitchInterval():
                try:
                    self._page_transfer(operation)
                finally:
                    self._publish_prefetch_ack(
                        PrefetchAck(
                            rid=operation.request_id,
                            completed_req=True,
                            operation=operation,
                        )
                    )

    def prefetch_sync_thread_func(self):
        """Acks are reduced and published by the I/O thread that makes them
        (_publish_prefetch_ack); nothing is queued for this thread any more."""
        return

    def _sync_prefetch_hit_query(self, operation, storage_hit_count: int) -> int:
        """Rank-reduce a hit query (MIN) so every rank agrees on the usable
        prefix. Runs for every operation, hit or miss."""
        if not self.prefetch_hits_sync_groups:
            # No other rank to agree with: the local count is the verdict.
            return storage_hit_count
        return int(
            self._min_across_ranks(storage_hit_count, self.prefetch_hits_sync_groups)
        )

    def _reduce_prefetch_ack(self, ack: PrefetchAck) -> None:
        """Synchronize all ranks to agree on a PrefetchAck."""
        if ack.completed_tokens is not None and self.prefetch_completion_sync_groups:
            # Determine the minimal successful prefix of tokens.
            ack.completed_tokens = self._min_across_ranks(
                ack.completed_tokens, self.prefetch_completion_sync_groups
            )

    def _min_across_ranks(self, values, groups):
        """MIN of `values` (an int, or a list of ints) over `groups`, read back
        with one tolist(): every caller's collective, in one place."""
        packed = torch.tensor(values, dtype=torch.int)
        self._all_reduce(packed, torch.distributed.ReduceOp.MIN, groups)
        return packed.tolist()


class HybridCacheControllerMethods:
    """Methods of sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController."""

    def prefetch(
        self,
        handle: CacheRequestHandle,
        new_input_tokens: List[int],
        last_hash: Optional[str] = None,
        prefix_keys: Optional[List[str]] = None,
        extra_pools: Optional[list[PoolTransfer]] = None,
        assume_stored: bool = False,
    ) -> PrefetchOperation:
        operation = PrefetchOperation(
            handle,
            new_input_tokens,
            last_hash,
            prefix_keys=prefix_keys,
            pool_transfers=extra_pools,
            assume_stored=assume_stored,
        )
        self._submit_hit_query(operation)
        return operation

    def _storage_hit_query(self, operation) -> tuple[list[str], int]:
        hash_value = operation.all_hash_values
        if hash_value is None:  # _submit_hit_query may have hashed them already
            hash_value = get_storage_hash_str(
                operation.token_ids, operation.last_hash, page_size=self.page_size
            )
        operation.all_hash_values = hash_value

        if operation.assume_stored:
            # A prior hit on a suffix of this span proved it stored, and writes
            # are prefix-covered, so re-querying only adds a round trip. Nothing
            # is verified now, so no pool gets a verdict to learn from.
            kv_hit_pages = len(hash_value)
            operation.pool_storage_result.update_kv_hit_pages(kv_hit_pages)
            operation.query_pool_hit_pages = {}
            return hash_value, kv_hit_pages * self.page_size

        extra_info = HiCacheStorageExtraInfo(
            prefix_keys=operation.prefix_keys.copy() if operation.prefix_keys else None,
        )
        if operation.pool_transfers:
            hit_result = self.storage_backend.batch_exists_v2(
                hash_value, operation.pool_transfers, extra_info
            )
        else:
            kv_hit_count = self.storage_backend.batch_exists(hash_value, extra_info)
            hit_result = PoolTransferResult(
                kv_hit_pages=kv_hit_count, extra_pool_hit_pages={}
            )

        kv_hit_pages = hit_result.kv_hit_pages
        operation.pool_storage_result.update_kv_hit_pages(kv_hit_pages)
        operation.pool_storage_result.restorable_prefix_pages = (
            hit_result.restorable_prefix_pages
        )
        # Each pool's own boundary (the KV pool's where the backend reports
        # it, else the folded cut); the beliefs heal pool by pool. A pool the
        # backend did not report carries no verdict.
        pool_hits = hit_result.extra_pool_hit_pages
        operation.query_pool_hit_pages = {
            PoolName.KV: pool_hits.get(PoolName.KV, kv_hit_pages)
        }
        for transfer in operation.pool_transfers or ():
            if transfer.name in pool_hits:
                operation.query_pool_hit_pages[transfer.name] = pool_hits[transfer.name]

        return (
            hash_value[:kv_hit_pages],
            kv_hit_pages * self.page_size,
        )

    def _page_transfer_sidecar(
        self, operation: PrefetchOperation, kv_completed_pages: int
    ) -> None:
        if operation.pool_transfers is None:
            return

        # Extra pools only after KV fully completes. If KV terminated early
        # (IO failure, timeout, TP mismatch), skip extra IO entirely to avoid
        # data misalignment.
        pool_hits: dict[str, int] = {}
        if not operation.is_terminated() and kv_completed_pages == len(
            operation.hash_value
        ):
            # KV-derived sidecar pools are handled in CacheController._page_transfer_kv_batch.
            # Only handle non-KV-derived sidecar pools here.
            transfers_nonkv = [
                transfer
                for transfer in operation.pool_transfers
                if transfer.indices_from_pool != PoolName.KV
            ]
            sidecar_hashes = operation.sidecar_hash_values or operation.hash_value
            sidecar_hit_pages = (
                operation.sidecar_hit_pages
                if operation.sidecar_hash_values is not None
                else kv_completed_pages
            )
            self._sync_trailing_keys(transfers_nonkv, sidecar_hashes, sidecar_hit_pages)
            self._resolve_sidecar_nonkv_derived_pool_transfers(operation)
            try:
                results = {}
                for extra_info, transfers in _trailing_chain_groups(
                    operation.prefix_keys,
                    sidecar_hashes,
                    transfers_nonkv,
                ):
                    results.update(
                        self.storage_backend.batch_get_v2(
                            transfers, extra_info=extra_info
                        )
                    )
                pool_hits = count_pool_hits(results)
            except Exception:
                logger.exception(
                    "HiCache sidecar prefetch failed for request %s",
                    operation.request_id,
                )
        # Publish a PrefetchAck even if the operation has been canceled by the scheduler
        # thread: every rank must make the same number of reductions.
        self._publish_prefetch_ack(
            PrefetchAck(
                rid=operation.request_id,
                operation=operation,
                pool_hits=pool_hits,
            )
        )
        return

    def _sync_prefetch_hit_query(self, operation, storage_hit_count: int) -> int:
        """One MIN collective for the folded hit count and every pool's own
        boundary, so per-pool beliefs stay rank-identical. A pool omitted
        by any rank heals from the folded cut without learning presence."""
        if any(
            transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES
            for transfer in operation.pool_transfers or []
        ):
            # A trailing state can exist at 512 and 1024 but not at 768. Taking
            # MIN of each rank's longest hit would choose a missing checkpoint,
            # so reduce one restorable flag per prefix length instead. Use the
            # request span (identical on every rank) for the collective shape,
            # including when one rank skipped its query due to cancellation.
            hits = [0] * (len(operation.token_ids) // self.page_size + 1)
            hits[0] = 1
            if storage_hit_count > 0:
                pages = operation.pool_storage_result.restorable_prefix_pages
                if pages is None:
                    # Backends without sparse-boundary results keep their
                    # contiguous-prefix contract. File and Mooncake return a set.
                    pages = range(1, storage_hit_count // self.page_size + 1)
                # Callers may cap the hit to allocated host space after the
                # query; a checkpoint past that cap has nowhere to load.
                for page in pages:
                    if 0 < page <= storage_hit_count // self.page_size:
                        hits[page] = 1
        else:
            hits = [storage_hit_count]
        pools = list(PoolName)
        local = operation.query_pool_hit_pages
        reduced = hits + [local.get(pool, _NO_POOL_VERDICT) for pool in pools]
        if self.prefetch_hits_sync_groups:
            # No tensor where no other rank must agree: making one cost this
            # thread a GIL hand-off under a busy scheduler.
            reduced = self._min_across_ranks(reduced, self.prefetch_hits_sync_groups)
        operation.query_pool_hit_pages = {
            pool: pages
            for pool, pages in zip(pools, reduced[len(hits) :], strict=True)
            if pages != _NO_POOL_VERDICT
        }
        if len(hits) == 1:
            return int(reduced[0])
        restorable = reduced[: len(hits)]
        return max(i for i, ok in enumerate(restorable) if ok) * self.page_size

    def _reduce_prefetch_ack(self, ack: PrefetchAck) -> None:
        # Handle KV-derived pool.
        super()._reduce_prefetch_ack(ack)

        # Handle other sidecar pools, e.g. SWA, Mamba.
        if ack.pool_hits is not None:
            # "for ... in PoolName" ensures the same order across all ranks.
            # On prefetch failure, pool_hits may be empty dict.
            hits = [ack.pool_hits.get(pool.value, 0) for pool in PoolName]
            if self.prefetch_completion_sync_groups:
                # One tolist() for every pool, not one Tensor.item() per pool.
                hits = self._min_across_ranks(hits, self.prefetch_completion_sync_groups)
            for pool, pages in zip(PoolName, hits):
                ack.pool_hits[pool.value] = pages

    def prefetch_sync_thread_func(self) -> None:
        """Acks are reduced and published by the I/O thread that makes them
        (_publish_prefetch_ack); nothing is queued for this thread any more."""
        return

    def _publish_prefetch_ack(self, ack: PrefetchAck) -> None:
        """Agree on `ack` across ranks, then hand it to the scheduler thread,
        or for a PP-broadcast operation record it and publish its ticket's
        completion. Runs on the I/O thread, in the order the acks are made."""
        self._reduce_prefetch_ack(ack)
        if not getattr(ack.operation, "is_pp_broadcast", False):
            self.ack_prefetch_queue.put(ack)
            return

        operation = ack.operation
        if ack.completed_tokens is not None:
            operation.completed_tokens = ack.completed_tokens
        if ack.pool_hits is not None:
            operation.pool_storage_result.update_extra_pool_hit_pages(ack.pool_hits)
            operation.pool_transfers_done = True
        if not ack.completed_req:
            return

        with self.pp_prefetch_state_lock:
            state = self.pp_prefetch_states.get(operation.request_id)
            if state is None:
                return
            operation.hash_value = operation.hash_value[
                : operation.completed_tokens // self.page_size
            ]
            operation.storage_hit_count = operation.completed_tokens
            state.ready_event.set()
            if state.release_requested:
                self._free_pp_prefetch_state(state)
                self.pp_prefetch_states.pop(operation.request_id, None)


# (SGLang module, class put in it, the class it goes before)
CLASSES = (
    ("sglang.srt.managers.cache_controller", HandoffQueue, "HiCacheController"),
    ("sglang.srt.managers.cache_controller", StorageSwitchInterval, "HiCacheController"),
)

# (SGLang module, class, holder, the stock method after which new methods go)
TARGETS = (
    ("sglang.srt.mem_cache.hicache_storage", "HiCacheStorage",
     HiCacheStorageMethods, "batch_exists"),
    ("sglang.srt.managers.cache_controller", "HiCacheController",
     HiCacheControllerMethods, "_generic_page_get"),
    ("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller", "HybridCacheController",
     HybridCacheControllerMethods, "prefetch_sync_thread_func"),
)
