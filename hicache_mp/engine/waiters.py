"""Waiters: how threads blocked in the engine sleep, and how workers wake them.

Owns the engine's side of the wake-up protocol below: each waiter's target,
the leader that sleeps on the completion semaphore for all, the followers'
condition, taking a leftover post, the caps on a sleep, waking everyone for
close(), and the wake-up counters. Must not apply completions itself (it
calls the drain it was given) nor count sleepers for close()
(hicache_mp.engine.closing does, around each sleep). It holds the engine's lock,
the ledger (the count of note 1), the drain and two questions (closed?
released?), never the engine.

The wake-up protocol. Every participant's comments cite these notes by
number ("waiters note 4"): this module (the engine's waiters),
hicache_mp.engine.ledger (the engine's count), workers/worker.py (the post side)
and workers/control.py (the words WAKE_AT, WAKE_SEQ, WAITERS, POSTED_SEQ,
POSTED_NS).

  1. The count. The engine counts the worker completions it has drained
     (the ledger's `worker_pages`; probes aside); a worker adds each page to its PAGES
     word before it pushes that page's completion. So the sum of every
     worker's PAGES is never below the engine's count, and reaches
     "count + an op's pages outstanding" no later than that op's last push.
     Pages the engine settles itself (cancelled, dropped, failed with a dead
     worker) are in neither, so a target is never built on them (decision 61).
  2. Targets. A thread waiting on an op sets the point at which its pages are
     surely done (note 1); WAKE_AT is the lowest target of all waiters, 0 if
     any waits on no op (post after every completion). A new target is
     numbered first (WAKE_SEQ += 1, then WAKE_AT), so a post made for an old
     one is never taken for it.
  3. Announcement. A waiter sets its target, then adds itself to WAITERS,
     then drains once more: a completion pushed before the announcement
     posted nothing (the worker saw no waiter), and this drain finds it. A
     worker reads WAITERS only after its push. The cap (note 7) covers what
     is left of that race.
  4. Posting (workers/worker.py). With WAITERS set, a worker posts the
     completion semaphore after a completion when WAKE_AT is 0, or once the
     sum of PAGES reaches WAKE_AT, and then only if that target's number is
     not marked posted (POSTED_SEQ) and no post is pending: workers finishing
     a batch's last pages together each see the target reached, and a second
     post would end the waiter's next sleep at once for nothing. It marks
     POSTED_SEQ, stores the clock in POSTED_NS (the `wait_gil_delay_ms`
     metric), and posts. A skipped post is safe: the pending or sent one is
     consumed after this completion was pushed, and the waiter drains after
     waking. So a batch wakes its waiter about once, not once per page
     (decisions 51, 67).
  5. Leader and followers. One waiting thread, the leader, sleeps on the
     semaphore with the engine's lock and the GIL released; the others wait
     on a condition that the leader notifies once it woke and drained. A post
     wakes whichever thread sleeps on a semaphore, so two threads on it woke
     each other's pages (decision 68). The leader is a thread, not a flag: a
     call nested on the leader's own thread (a signal handler that
     interrupted its sleep) leads in its turn, since that sleep is not asleep
     while the handler runs.
  6. Leftover posts. When no thread sleeps on the semaphore, a post still
     pending is left over from a wait that ended without sleeping (its last
     page drained just before the worker posted). A leader with a target
     takes it first, with the GIL held (libc's sem_trywait), so it cannot end
     this sleep at once for a GIL hand-back.
  7. Caps. A sleep with a target lasts until its batch is done or
     TARGET_CAP_S: each early expiry takes the GIL back once, which under a
     busy scheduler costs up to a switch interval, so a long batch must not
     be cut into short naps; the cap is for a worker that dies mid-batch.
     With no target, NO_TARGET_CAP_S.
  8. Close. close() posts the semaphore for a leader on another thread and
     notifies the followers (`wake_all`), then waits for them to leave
     (hicache_mp.engine.closing). Once the control block and semaphore are released
     (`released()`), nothing here touches them, and a sleep on the closed
     semaphore ends at once (shm.wake).
  9. Waking ahead. Under a busy scheduler a waiter woken by a post runs
     again only once the GIL comes back, up to a switch interval later
     (`gil_delay_s`, note 4); idle, at once. So a leader whose hand-backs are
     slow (over AHEAD_MIN_S) lowers its target by the pages the workers
     finish in most of that time (AHEAD_SHARE; `rate_pps`, measured over its
     own earlier sleeps): the GIL comes back as the batch's last pages land,
     not a switch interval after. An op too short to lower the target for
     (a page or so: one big sidecar page) is not woken ahead: its one
     page's time varies too much to guess, and a guess too early costs a
     second sleep (decision 85). Woken ahead and not yet done, it drains
     with the GIL held while the rest is due within SPIN_CAP_S (never
     longer), else it sleeps again, then with no lead. A batch due within
     SPIN_CAP_S from the start (a sidecar's small page or two) is drained
     so, with no sleep at all. A target lowered too far costs a second
     sleep, never a wrong answer: an op is done only when its own pages are
     drained (decision 80).

Runs on the scheduler's threads: all of it under the engine's lock, and the
leader's one sleep is the only place the GIL is given up (decision 74).
"""
import threading
import time
from typing import Callable

from workers.control import POSTED_NS, WAITERS, WAKE_AT, WAKE_SEQ
from workers.timing import AHEAD_MIN_S, AHEAD_SHARE, NO_TARGET_CAP_S, SPIN_CAP_S, TARGET_CAP_S

from .ledger import OpLedger


class Waiters:
    """The waiters of one engine: `lock` is its lock, `ledger` its books
    (hicache_mp.engine.ledger: the count of note 1), `drain` its drain (applies what
    the rings hold; returns the pages applied), `closed` and `released` say
    whether it is closed and whether its control block and semaphore are gone
    (note 8); `control` and `done_sem` are that control block and completion
    semaphore."""

    def __init__(self, lock, ledger: OpLedger, drain: Callable[[], int],
                 closed: Callable[[], bool], released: Callable[[], bool], control, done_sem):
        self.lock, self.ledger, self.drain = lock, ledger, drain
        self.closed, self.released = closed, released
        self.control, self.done_sem = control, done_sem
        self.targets: list = []  # wake-up target of each thread in wait(); 0: none (note 2)
        self.leader = None       # the thread that sleeps on done_sem for all (note 5)
        self.woken = threading.Condition(lock)
        # Sleeps ended by a worker's post, by the cap; posted wakes that found
        # their target not reached (a post left over from an earlier wait); and
        # leftover posts taken before a sleep (never slept on, note 6).
        self.posted = self.expired = self.stale = self.leftover = 0
        self.gil_delay_s = 0.0   # EWMA: a worker's post -> the waiter runs again (note 4)
        self.rate_pps = 0.0      # EWMA: pages/s the workers finish while a leader sleeps (note 9)
        self.ahead_op = None     # the op a leader last woke ahead of: its later sleeps have no lead
        self.ahead = self.spun = 0   # posted wakes ahead of a batch's end; spins (note 9)
        self.spin_s = 0.0

    def sleep(self, timeout_s: float, op=None) -> None:
        """Sleep until `op`'s batch is surely done (or, with no op, the next
        completion), the cap, or `timeout_s`; drains before returning.
        The lock makes the counter update atomic across waiting threads (SGLang
        blocks in several: its backup thread in batch_set_v1 while its I/O
        thread waits in batch_get_v1) and keeps the rings single-consumer."""
        me = threading.get_ident()
        with self.lock:
            if self.released():  # note 8
                return
            target = op is not None and not op.done
            prev = self.leader
            lead = prev is None or prev == me  # note 5
            short = target and lead and self._due_soon(op)  # note 9
            early = self._lead(op) if target and lead and not short else 0  # note 9
            at = self.ledger.worker_pages + op.pages_left - early if target else 0  # notes 1, 9
            cap = min(timeout_s, TARGET_CAP_S if target else NO_TARGET_CAP_S)  # note 7
            if lead and at:
                self.leftover += self.done_sem.take_pending()  # note 6
            self.targets.append(at)
            self._set_wake_at()
            self.control.words[WAITERS] += 1
            drained = self.drain()  # note 3
            if short and not drained and not self.closed():
                drained = self._spin(op)  # note 9: due within SPIN_CAP_S, no sleep
            if drained or not lead:
                try:
                    if drained:
                        self.woken.notify_all()  # those pages may end a follower's op
                    elif not self.closed():
                        self._count(self.woken.wait(cap), at, follower=True)
                finally:
                    self._leave(at)
                return
            self.leader = me
            since = (time.monotonic_ns(), self.control.pages_done())
        posted = False
        try:
            # The one place the GIL is given up: counted (posted wake-ups and
            # cap expiries) so the GIL cost of a batch can be measured
            # (scripts/sglang_stack.py prints it).
            posted = self.done_sem.wait(cap)
        finally:
            with self.lock:
                self.leader = prev
                self._count(posted, at, since=since)
                if not self.closed():
                    self.drain()  # the followers' ops too, before they look
                    if early and posted:
                        self.ahead += 1
                        if not op.done and self._due_soon(op):
                            self._spin(op)  # note 9
                self.woken.notify_all()
                self._leave(at)

    def _lead(self, op) -> int:
        """How many pages ahead of `op`'s end to be woken (note 9): those the
        workers finish while the GIL comes back; 0 where it comes back at once,
        with no pace measured yet, for an op too short to lower the target
        for, or on any sleep after a wake-ahead for the same op (a stale post
        may end one early)."""
        if op is self.ahead_op or self.gil_delay_s < AHEAD_MIN_S or self.rate_pps <= 0:
            return 0   # an op is woken ahead of once at most
        n = min(int(AHEAD_SHARE * self.gil_delay_s * self.rate_pps), op.pages_left // 2)
        if n:
            self.ahead_op = op
        return n

    def _due_soon(self, op) -> bool:
        """Under slow hand-backs, `op`'s pages are due within SPIN_CAP_S (note 9)."""
        return (self.gil_delay_s >= AHEAD_MIN_S and self.rate_pps > 0
                and op.pages_left <= SPIN_CAP_S * self.rate_pps)

    def _spin(self, op) -> bool:
        """Drain, GIL held, until `op` is done or SPIN_CAP_S has passed (note
        9; a batch's fixed latency, a worker's pickup, is not in the pace, so
        the cap, not the due time, bounds it); True if it is done."""
        drain, closed = self.drain, self.closed
        t0 = time.monotonic()
        until = t0 + SPIN_CAP_S
        while not op.done and not closed() and time.monotonic() < until:
            drain()
        self.spun += 1
        self.spin_s += time.monotonic() - t0
        return op.done

    def _set_wake_at(self) -> None:
        """WAKE_AT for the waiters now: the lowest target, 0 if any has none,
        each new target numbered first (note 2)."""
        if self.released():
            return
        words = self.control.words
        targets = self.targets
        at = 0 if not targets or 0 in targets else min(targets)
        if at:
            words[WAKE_SEQ] += 1
        words[WAKE_AT] = at

    def _leave(self, at: int) -> None:
        self.targets.remove(at)
        if self.released():  # the control block is gone: nobody counts waiters now
            return
        self.control.words[WAITERS] -= 1
        self._set_wake_at()

    def _count(self, posted: bool, at: int, follower: bool = False, since=None) -> None:
        if posted:
            self.posted += 1
        else:
            self.expired += 1
        if not posted or not at or follower or self.released():
            return
        if self.control.pages_done() < at:
            self.stale += 1
            return
        now, posted_ns = time.monotonic_ns(), int(self.control.words[POSTED_NS])
        # from the worker's post to running again: the GIL's price
        self.gil_delay_s += 0.25 * ((now - posted_ns) / 1e9 - self.gil_delay_s)
        if since is not None:  # the workers' pace while this leader slept (note 9)
            t0, pages0 = since
            n, dt = at - pages0, posted_ns - t0
            if n >= 1 and dt > 0:
                rate = n * 1e9 / dt
                self.rate_pps += (0.25 * (rate - self.rate_pps)) if self.rate_pps else rate

    def wake_all(self) -> None:
        """The leader (it alone sleeps on the semaphore) and its followers;
        called by close() with the lock held. A leader on the caller's own
        thread is interrupted, not asleep: it finds the engine closed (note 8)."""
        me = threading.get_ident()
        if self.leader is not None and self.leader != me:
            self.done_sem.post()
        self.woken.notify_all()

    def metrics(self) -> dict:
        return {"wait_wakeups_posted": self.posted, "wait_wakeups_timeout": self.expired,
                "wait_wakeups_stale": self.stale, "wait_leftover_posts_taken": self.leftover,
                "wait_gil_delay_ms": round(self.gil_delay_s * 1e3, 3),
                "wait_woken_ahead": self.ahead, "wait_spins": self.spun,
                "wait_spin_ms": round(self.spin_s * 1e3, 3),
                "wait_pages_per_s": round(self.rate_pps, 1)}
