"""Closing an engine: close(), safe from any thread and from a signal handler.

Owns close()'s order (refuse new work, cancel the prefetches, flush the
backups, stop the I/O, cancel what is left, wake the other threads' sleepers
and wait for them to leave, release shared memory), the per-thread count of
threads asleep inside the engine, and the close report. Must not move page
bytes or know the workers: the engine's I/O backend (`_io`:
shutdown, wake_all, release; hicache_mp.engine.iobackend) does that.

A server closes the engine in its SIGTERM handler, and a handler runs on the
main thread between two bytecodes, perhaps in the middle of an engine call on
that very thread: asleep in wait(), or holding the engine's lock half-way
through an update. So close() never waits for its own thread: sleepers are
counted per thread and the calling thread's are left out (its interrupted
sleep notices the close when the handler returns, and raises EngineClosed),
and its flush does not enter the sleep protocol when this thread is already
inside it, but polls. A flush that interrupted this thread's own update of
the engine cannot see what that update holds (completions popped but not yet
applied, an op not yet handed out), so there it also ends once no backup page
has moved for FLUSH_QUIET_S. A close() that interrupted a close() on its
thread finishes it (flushing) or releases everything at once (stopping), so a
handler that exits right after leaves nothing behind. Every call that a close
interrupted, or that comes after it, ends with EngineClosed (EngineCore
translates what the released resources raise).
"""
import logging
import threading
import time

import numpy as np

from workers import status as st
from workers.timing import FLUSH_IDLE_S, FLUSH_POLL_S, FLUSH_QUIET_S, SLEEPERS_GONE_S, SLOW_CLOSE_S

from .ops import READ, WRITE

log = logging.getLogger("hicache_mp")

# A flush that interrupted this thread's own update of the engine gives up
# after this long without a backup page completing: longer than a write is
# deferred behind reads (workers.share.WRITE_DEFER_MAX_S, 0.5 s); and after
# FLUSH_IDLE_S of that while no record waits in a ring and no worker is in a
# page I/O (the pages left were never handed out, or their completions sit in
# the interrupted frame).


class EngineClosed(RuntimeError):
    """The engine was closed; it accepts no more work."""


class EngineForked(EngineClosed):
    """This process is a fork of the one that made the engine: the engine's
    workers, rings and segments belong to the parent, so here it is closed."""


class Closing:
    """EngineCore's close(): the mixin's state is set by `_init_closing`."""

    def _init_closing(self) -> None:
        self._sleepers: dict = {}      # thread id -> its frames asleep in the I/O's sleep
        self._in_close: dict = {}      # thread id -> its frames inside close()
        self._sleepers_gone = threading.Condition(self._lock)
        self._closer = None            # the thread whose close() came first
        self._close_done = threading.Event()
        self._close_report = None

    # --- the sleepers protocol (wait(), exists() waiting for probes) -----------
    def _enter_sleep(self) -> bool:
        """Count this thread as asleep in the engine; False once nothing is left to sleep on."""
        with self._lock:
            if self._released:
                return False
            me = threading.get_ident()
            self._sleepers[me] = self._sleepers.get(me, 0) + 1
            return True

    def _leave_sleep(self) -> None:
        with self._lock:
            me = threading.get_ident()
            n = self._sleepers.get(me, 0) - 1
            if n > 0:
                self._sleepers[me] = n
            else:
                self._sleepers.pop(me, None)
            self._sleepers_gone.notify_all()

    def _sleep_counted(self, timeout_s: float, op=None) -> bool:
        """One sleep of the I/O backend's, this thread counted asleep for close()
        meanwhile; False (no sleep) once nothing is left to sleep on."""
        if not self._enter_sleep():
            return False
        try:
            self._io.sleep(timeout_s, op)
        finally:
            self._leave_sleep()
        return True

    def _others_asleep(self, me: int) -> bool:
        """Threads other than `me` asleep in the engine and not themselves
        inside close() (one that is waits for `me`; its sleep is safe either
        way: shm.wake closes a semaphore's handles only once nobody is in them)."""
        return any(t != me and t not in self._in_close for t in self._sleepers)

    # --- close ------------------------------------------------------------------
    def close(self, flush: bool = True, timeout_s: float = 30.0) -> None:
        """Stop the I/O and release everything. With `flush` (the default, like
        Executor.shutdown(wait=True)) backups in flight are first let finish, for
        up to `timeout_s` in all, so leaving a `with` block right after backup()
        loses nothing; pages still unwritten then, and every prefetch in flight,
        end CANCELLED. New work is refused from the moment close() starts.

        Safe from any thread and from a signal handler, whatever the calling
        thread was doing inside the engine; every call a close interrupted, or
        that comes after it, raises EngineClosed. A second close() returns once
        the first is done. `metrics()["close"]` and one log line say what the
        flush wrote, how long giving the shared memory back took (the kernel
        frees a big pool's pages then: seconds for tens of GB), and, when the rest of
        close() took over a second or left backup pages unwritten, why."""
        if self._forked:
            self._refuse_in_child()
        if self._close_done.is_set():
            return
        me = threading.get_ident()
        with self._lock:
            first = self._closer is None
            if first:
                self._closer = me
                self._closing = True
            shutting = self._closed
            self._in_close[me] = self._in_close.get(me, 0) + 1
        try:
            if not first and self._closer != me:
                self._close_done.wait(timeout_s + 2 * SLEEPERS_GONE_S)
                return
            if not first and shutting:
                # A signal handler interrupted this thread's close() while it
                # stopped the I/O: release everything now, in case the handler
                # exits; the interrupted close() goes on over what is left.
                self._release_now()
                return
            t0 = time.monotonic()
            report = self._flush(timeout_s if flush else 0.0)
            if not flush and report["cancelled_pages"]:
                report["why"] = "close(flush=False)"
            self._shut(t0, report)
        finally:
            with self._lock:
                n = self._in_close.get(me, 0) - 1
                if n > 0:
                    self._in_close[me] = n
                else:
                    self._in_close.pop(me, None)

    def _flush(self, timeout_s: float) -> dict:
        """Let the backups in flight finish, for up to `timeout_s`. Prefetches
        are cancelled first: close() cancels them anyway, and reads in flight
        hold every worker's writes back (reads first)."""
        me = threading.get_ident()
        held = self._lock._is_owned()  # a handler interrupted this thread's own update
        t0 = time.monotonic()
        with self._lock:
            if self._closed:
                return _flush_report(0, 0, 0.0, "closed already")
            asleep = me in self._sleepers
            ops = self._ledger.ops()
            writes = [op for op in ops if op.kind == WRITE and not op.done]
            for op in ops:
                if op.kind == READ and not op.done:
                    op.mark_cancelled()
                    self._io.cancel(op)
        pages = sum(op.pages_left for op in writes)
        deadline = t0 + timeout_s
        try:
            if held or asleep:
                why = self._flush_polling(writes, deadline, timeout_s, quiet=held)
            else:
                why = self._flush_waiting(writes, deadline, timeout_s)
        except EngineClosed:
            why = "a close() from a signal handler closed the engine meanwhile"
        except Exception as exc:  # the stop must go on: say why the flush ended
            why = f"the flush failed: {exc!r}"
        left = sum(op.pages_left for op in writes)
        return _flush_report(pages, pages - left, time.monotonic() - t0, why if left else None)

    def _flush_waiting(self, writes, deadline: float, timeout_s: float):
        for op in writes:
            left = deadline - time.monotonic()
            if left <= 0 or not self.wait(op, left):
                return f"not done within the flush limit of {timeout_s}s"
        return None

    def _flush_polling(self, writes, deadline: float, timeout_s: float, quiet: bool):
        """The flush of a close() on a thread already inside the engine: polls,
        never sleeps in the engine's sleep protocol (this thread's own sleep
        there is interrupted, not asleep)."""
        todo, last, since, idle_since = list(writes), -1, time.monotonic(), None
        if quiet:
            self._io.nudge()  # the update it interrupted may have queued pages unannounced
        while True:
            self.poll()
            todo = [op for op in todo if not op.done]
            if not todo:
                return None
            now = time.monotonic()
            if now >= deadline:
                return f"not done within the flush limit of {timeout_s}s"
            if quiet:
                remaining = sum(op.pages_left for op in todo)
                if remaining != last:
                    last, since, idle_since = remaining, now, None
                    continue
                idle_since = (idle_since or now) if self._io.idle() else None
                if now - since >= FLUSH_QUIET_S or \
                        (idle_since is not None and now - idle_since >= FLUSH_IDLE_S):
                    return (f"no backup page completed for {now - since:.2f}s after close() "
                            f"interrupted an engine call on its own thread (a signal handler): "
                            f"the pages left were not handed out to the I/O, or their "
                            f"completions were taken by that call")
            time.sleep(FLUSH_POLL_S)

    def _shut(self, t0: float, report: dict) -> None:
        """Stop the I/O, end every op, release: once, under the lock."""
        me = threading.get_ident()
        error = None
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                for fn in self._before_unmap:   # on_close(): the pool is still mapped
                    try:
                        fn()
                    except Exception as exc:    # the workers must stop all the same
                        error = error or exc
                try:
                    self._io.shutdown()
                except Exception as exc:
                    if not self._released:  # else a nested close() released it under us
                        error = exc
                now = time.perf_counter_ns()
                ledger = self._ledger
                # the I/O is shut down: no killed worker writes a slot any more,
                # and an op held for one must end with the rest
                ledger.unfence_all(now)
                for op in ledger.ops():
                    op.mark_cancelled()
                    try:
                        for pos in np.flatnonzero(op.page_status == st.PENDING):
                            ledger.apply(op, int(pos), st.CANCELLED, 0, 0, now)
                    except Exception as exc:
                        # An op caught half-made (this close() interrupted the
                        # prefetch() or backup() making it on this thread) is
                        # no error: that call resumes and ends EngineClosed.
                        if op.pin_slots is not None and error is None:
                            error = exc
                # Sleepers on other threads leave the semaphore before it goes;
                # this thread's own (a handler that interrupted its wait) find
                # the engine closed when the handler returns.
                self._io.wake_all()
                if not self._sleepers_gone.wait_for(lambda: not self._others_asleep(me),
                                                    timeout=SLEEPERS_GONE_S):
                    log.warning("hicache_mp close(): threads still inside wait() after %ss; "
                                "releasing anyway", SLEEPERS_GONE_S)
            finally:
                t_release = time.monotonic()
                self._release_now()
                now = time.monotonic()
                report["release_s"] = round(now - t_release, 4)
                report["close_s"] = round(now - t0, 4)
                self._close_report = report
                self._close_done.set()
        _log_report(report)
        if error is not None:
            raise error

    def _release_now(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
            self._io.release()


def _flush_report(pages: int, flushed: int, flush_s: float, why) -> dict:
    return {"backup_pages": pages, "flushed_pages": flushed, "cancelled_pages": pages - flushed,
            "flush_s": round(flush_s, 4), "why": why}


def _log_report(r: dict) -> None:
    # Giving a big host pool back is the kernel freeing its pages, not a
    # stuck close: it does not make a close() slow enough to warn about.
    release_s = r.get("release_s", 0.0)
    if r["cancelled_pages"] or r["close_s"] - release_s > SLOW_CLOSE_S:
        log.warning("hicache_mp close() took %.2fs: %d of %d backup page(s) in flight flushed "
                    "in %.2fs, %d cancelled%s; shared memory released in %.2fs",
                    r["close_s"], r["flushed_pages"], r["backup_pages"], r["flush_s"],
                    r["cancelled_pages"], f" ({r['why']})" if r["why"] else "", release_s)
    else:
        log.info("hicache_mp close() took %.3fs: %d backup page(s) in flight flushed; "
                 "shared memory released in %.3fs", r["close_s"], r["flushed_pages"], release_s)
