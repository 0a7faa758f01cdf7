"""IndexLookups: which keys have a page in the store, as far as this engine knows.

Owns the public calls on the exists index (exists, exists_at_once, ask,
present, awaiting_discovery, mark_present, forget_all, indexed_pages, refresh,
wait_scanned) and the wait for probe answers. Must not make a system call on
the caller's thread (the index is in memory; workers stat the store for keys
it misses, hicache_mp.engine.discovery; a scanner process lists it,
hicache_mp.engine.storescan) nor let the GIL go outside the engine's one
sleep (decision 74).

`IndexLookups` is a mixin of EngineCore, whose `__init__` makes the index,
the discovery table and the lock it uses. (The vLLM adapter's per-step
lookups are hicache_mp.integrations.vllm.lookup.Lookups, on top of these.)
"""
import time

import numpy as np

from workers import naming
from workers.timing import PROBE_WAIT_SLICE_S, SCAN_PROBE_WAIT_S

# wait_scanned() sleeps this long between polls: each poll takes a share of
# the scan's ring (hicache_mp.engine.storescan.TAKE_PER_POLL), and the
# scanner refills it in about as long.
SCAN_WAIT_SLICE_S = 0.001

from .closing import EngineClosed
from .index import StoreIndex


class IndexLookups:
    """EngineCore's exists-index calls."""

    def exists(self, keys, *, wait_s: float = 0.0) -> int:
        """How many leading keys have a page in the store.

        No syscall here. The keys the index does not know are asked of the
        store by workers (one stat each, at most once per PROBE_TTL_S per
        key; hicache_mp.engine.discovery): when none of the prefix is known, its
        first key alone, and once that one is found, the keys after it
        together: pages another engine wrote are found by a later call once
        `poll()` has the answers, or by this one with `wait_s` > 0, which
        waits up to that long (GIL released) for them. Head first because a
        prefix whose first missing page is absent is no longer whatever
        follows: asking about the rest would cost the store a stat per key,
        and this thread a digest per key, for nothing. EngineClosed once the
        engine is closed (also when a close() interrupted this call).

        Until the store scan at start has ended whole (`metrics()["store_scan"]`,
        decision 110) the index may not know pages the store holds, so a key
        it misses is no sign of a miss: then this waits at least
        SCAN_PROBE_WAIT_S for the workers' answers (a stat each), whatever
        `wait_s`; SGLang's and vLLM's callers take a short answer as a miss.
        """
        self._check_open()
        try:
            n = self._exists(keys, wait_s)
        except Exception as exc:
            raise self._closed_during("exists()", exc)
        if self._closed:
            raise EngineClosed("engine was closed during exists()")
        return n

    def _exists(self, keys, wait_s: float) -> int:
        if not isinstance(keys, (list, tuple)):
            keys = list(keys)
        n = self._leading(keys)
        if n == len(keys):
            return n
        if not self._index.complete:
            wait_s = max(wait_s, SCAN_PROBE_WAIT_S)
        deadline = time.monotonic() + wait_s
        # A prefix whose first pages are known is asked about whole (its
        # writer likely wrote on); one with none known, head first.
        head = n == 0
        while True:
            self._ask(keys[n:], deadline, whole=not head)
            found = self._leading(keys[n:])
            if not head or not found or time.monotonic() >= deadline:
                return n + found
            n, head = n + found, False  # the head is there: ask about the rest
            if n == len(keys):
                return n

    def exists_at_once(self, keys) -> int | None:
        """What `exists(keys, wait_s=...)` would answer now, with no wait
        whatever its `wait_s`; None if it would have to wait. It answers at once
        when every key is indexed, or when the first one the index misses (and,
        past a known head, the misses after it) was asked of the store within
        PROBE_TTL_S and answered. For a caller that must not block (a scheduler
        thread): one pass over the keys, no syscall, no lock, no probe sent."""
        if self._forked:
            self._refuse_in_child()
        if self._closed:
            return None
        if not isinstance(keys, (list, tuple)):
            keys = list(keys)
        n = self._leading(keys)
        # as _exists asks: the head alone when none of the prefix is known
        if n < len(keys) and self._discovery.would_wait(keys[n:], n > 0, self.namespace,
                                                        self._index.digests):
            return None
        return n

    def ask(self, keys, *, wait_s: float = 0.0) -> None:
        """Ask the store about every key the index misses, not only a prefix's
        head (a sidecar pool's trailing pages; `present()` then says which are
        there); waits up to `wait_s` for the answers, as `exists()` does."""
        self._check_open()
        keys = list(keys)
        ns, known = self.namespace, self._index.digests
        missing = [k for k in keys if naming.key_digest(k, ns) not in known]
        if missing:
            try:
                self._ask(missing, time.monotonic() + wait_s, whole=True)
            except Exception as exc:
                raise self._closed_during("ask()", exc)

    def awaiting_discovery(self, keys) -> bool:
        """Whether a probe of one of `keys` is out and not yet answered (an
        `ask()` or `exists()` sent it; `poll()` takes the answer in). No
        syscall, no lock: one set lookup per key, as `present()`."""
        if self._forked:
            self._refuse_in_child()
        return self._discovery.awaiting(keys, self.namespace)

    def _ask(self, keys, deadline: float, whole: bool) -> None:
        """Probe `keys` (the first is unknown; with `whole`, the rest too) and
        wait until they are answered or `deadline`."""
        with self._lock:
            self._check_open()
            # Answers to earlier asks first: one left undrained past ANSWER_LOST_S
            # (nobody polled: an idle server) would be taken for this ask's.
            self._io.drain()
            waiting = self._io.probe(keys, whole)
        while waiting and time.monotonic() < deadline:
            self.poll()  # EngineClosed once closed
            left = deadline - time.monotonic()
            if left <= 0 or waiting.isdisjoint(self._discovery.waiting):
                return
            self._sleep_counted(min(left, PROBE_WAIT_SLICE_S))

    def _leading(self, keys) -> int:
        ns, known = self.namespace, self._index.digests
        n = 0
        for key in keys:
            if naming.key_digest(key, ns) not in known:
                break
            n += 1
        return n

    def present(self, keys) -> np.ndarray:
        """One bool per key: is its page in the store, as far as the index knows (no syscalls)."""
        if self._forked:
            self._refuse_in_child()
        ns, have = self.namespace, self._index.digests
        return np.array([naming.key_digest(k, ns) in have for k in keys], dtype=bool)

    def mark_present(self, keys) -> None:
        """Tell the index these keys' pages are in the store (another process wrote them)."""
        if self._forked:
            self._refuse_in_child()
        ns = self.namespace
        with self._lock:
            for key in keys:
                self._index.add(naming.key_digest(key, ns))

    def forget_all(self) -> None:
        """Empty the index (the store was cleared under it)."""
        if self._forked:
            self._refuse_in_child()
        with self._lock:
            self._index.digests.clear()

    def indexed_pages(self) -> int:
        """Pages the index knows of."""
        return len(self._index)

    def wait_scanned(self, timeout_s: float | None = None) -> bool:
        """Poll until the store scan running (at start, or a rescan) has ended
        or `timeout_s` passed (None: no limit); whether the index is whole (a
        scan has ended whole). For a bench, a test or a server that wants the
        index whole before it serves; exists() is right without it."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self.poll()  # EngineClosed once closed
            if not self._index.scanning:
                return self._index.complete
            left = SCAN_WAIT_SLICE_S if deadline is None else \
                min(SCAN_WAIT_SLICE_S, deadline - time.monotonic())
            if left <= 0:
                return False
            self._sleep_counted(left)

    def refresh(self) -> int:
        """Rescan the store (picks up pages other engines wrote), and wait for
        it. Returns the count. An engine that scans in the background
        (the `mp` engine, decision 110) has its scanner walk the store, after
        the scan running; the baselines walk it on this thread."""
        if self._forked:
            self._refuse_in_child()
        if self._background_scan:
            with self._lock:
                self._check_open()
                self._io.rescan()
            self.wait_scanned()
            return len(self._index)
        found = StoreIndex(self._store)
        found.scan()
        with self._lock:
            self._index.add_scanned(found.digests, listed=False)
            return len(self._index)
