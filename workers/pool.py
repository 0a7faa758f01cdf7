"""WorkerPool: starts, watches, replaces and stops the I/O worker processes.

    engine (scheduler process)                 worker i  (python -m workers.worker)
    --------------------------                 ------------------------------------
    read_ring[i].push(reads)   -------------->  pop, do I/O into/out of the pool
    write_ring[i].push(writes) -------------->    (reads first: workers.worker)
    wake[i].post()  (once per batch)              (sleeps on wake[i] when idle)
    completion_ring[i].pop()  <---------------  push completion, post done if WAITERS
    dead(): a worker that exited is reported;   exits on STOP or when its parent dies
    respawn(): its replacement starts in the
    background, on the emptied rings once the
    old process is reaped (else on new ones)
    poll_starting(): replacements that are
    ready now take work (usable())

Owns process lifecycle (through workers.child): every move of a worker's
`WorkerState` (workers.handle: the state diagram and the one table of moves)
is made here, the supervisor's included (`kill_stuck`), and `usable()`,
`dead()`, `starting`, `dying` and `reaped()` read the state, never a list's
membership. Also owns the per-worker rings and wake semaphore, and the
pool's one terminal broken state. Must not interpret records: the engine
does that.

Replacements never block the caller: `respawn` launches the new worker and
returns; the worker maps and pre-populates the host pool (seconds for tens of
GB) on its own time, and `poll_starting` (a load per starting worker) says
when it is ready. Until then `usable()` leaves it out, so new work goes to
the ready workers; with none ready, pages wait in the new worker's ring.

Broken (as CPython's process pool executor): set once, under one lock, when a
replacement cannot be launched, or MAX_START_FAILURES replacements in a row
for one slot exit (or time out) before they are ready; it is terminal (no
more respawns) and `check()` raises BrokenPool on every later submission. A
pool that is not broken never refuses work.

Shutdown protocol (close()):
  1. set STOP in the control block;
  2. post every worker's wake semaphore, so sleepers see STOP at once;
  3. wait up to `grace_s` for every worker to exit;
  4. SIGKILL stragglers and reap them;
  5. close and unlink every ring and semaphore the pool created.
"""
import os
import threading
import time

from shm import Ring, WakeSemaphore
from shm.segment import ShmFullError
from workers.child import Child, ChildStartError, wait_ready
from workers.control import INFLIGHT, INFLIGHT_KEY, MAX_WORKERS, READS_DONE, READS_SUBMITTED, \
    READY_PID, STOP, WANT, Control
from workers.handle import KILLED_UNREAPED, WorkerHandle, WorkerState, WorkerStateError
from workers.spec import WorkerSpec
from workers.timing import STOP_GRACE_S

S = WorkerState

# Replacements of one slot that may fail to start in a row before the pool is
# broken: one can be killed by an operator or the OOM killer; three in a row is
# the environment (an import error, no memory), and retrying would only spin.
MAX_START_FAILURES = 3


def worker_cpus() -> list[int]:
    """CPUs for pinned workers: all we may run on, minus the scheduler's core.

    The core the caller runs on now, and its hyperthread siblings, are kept
    free: a worker on a sibling shares the core's pipeline and slows the
    scheduler's Python loop about as much as sharing the CPU itself. The
    caller's own affinity is left alone (threads inherit it, so pinning the
    scheduler here would also confine every thread it starts later); pin the
    scheduler with `taskset` if the OS keeps moving it.
    """
    allowed = sorted(os.sched_getaffinity(0))
    cpu = os.sched_getcpu() if hasattr(os, "sched_getcpu") else allowed[0]
    keep = {cpu}
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            keep |= set(_parse_cpu_list(f.read()))
    except OSError:
        pass
    rest = [c for c in allowed if c not in keep]
    return rest or allowed


def _parse_cpu_list(text: str) -> list[int]:
    out = []
    for part in text.strip().split(","):
        if "-" in part:
            lo, hi = part.split("-")
            out.extend(range(int(lo), int(hi) + 1))
        elif part:
            out.append(int(part))
    return out


class WorkerStartError(ChildStartError):
    """A worker could not be started (it exited or never became ready)."""


class BrokenPool(RuntimeError):
    """The pool is closed or could not replace a dead worker."""


class WorkerPool:
    def __init__(self, *, num_workers: int, tag: str, control: Control, spec: WorkerSpec,
                 ring_capacity: int, pin_cpus: list[int] | None = None,
                 start_timeout_s: float = 60.0):
        if not 1 <= num_workers <= MAX_WORKERS:
            raise ValueError(f"num_workers must be in [1, {MAX_WORKERS}], got {num_workers}")
        self.tag = tag
        self.control = control
        self.spec = spec
        self.ring_capacity = ring_capacity
        self.pin_cpus = pin_cpus
        self.start_timeout_s = start_timeout_s
        self.respawns = 0
        self.workers: list[WorkerHandle] = []   # each slot's current handle
        # Every handle launched and not GONE yet, in launch order: the current
        # ones and killed predecessors not reaped yet. Where each one stands is
        # its state (workers.handle), never which list holds it.
        self._handles: list[WorkerHandle] = []
        self.closed = False
        # Reentrant: close() may run in a signal handler that interrupted
        # this thread inside check() or broken (hicache_mp.engine.closing).
        self._lock = threading.RLock()
        self._broken: str | None = None
        self._start_failures = [0] * num_workers
        try:
            for i in range(num_workers):
                self.workers.append(self._spawn(i, 0))
            try:
                wait_ready([h.child for h in self.workers], start_timeout_s)
            except ChildStartError as exc:
                raise WorkerStartError(str(exc)) from None
            for h in self.workers:
                h.to(S.READY)
        except BaseException:
            self.close()
            raise

    def __len__(self) -> int:
        return len(self.workers)

    @property
    def starting(self) -> list[WorkerHandle]:
        """Replacements launched and not ready yet, in launch order."""
        return [h for h in self._handles if h.state is S.STARTING]

    @property
    def dying(self) -> list[WorkerHandle]:
        """Killed workers not reaped yet (DYING, DYING_UNREPLACED)."""
        return [h for h in self._handles if h.state in KILLED_UNREAPED]

    # --- the broken state -----------------------------------------------------------
    @property
    def broken(self) -> str | None:
        with self._lock:
            return self._broken

    def _break(self, why: str) -> None:
        with self._lock:
            if self._broken is None:
                self._broken = why

    def check(self) -> None:
        """Raise BrokenPool if this pool takes no more work (broken or closed)."""
        with self._lock:
            if self._broken is not None:
                raise BrokenPool(f"engine is broken: {self._broken}")
            if self.closed:
                raise BrokenPool("pool is closed")

    # --- lifecycle ----------------------------------------------------------
    def _spawn(self, index: int, generation: int, reuse: tuple | None = None) -> WorkerHandle:
        """Launch worker `index`: on new rings, or on `reuse`, the emptied rings of a
        predecessor that is gone (reaped): a replacement then needs no new
        /dev/shm, so it starts even when something else has filled /dev/shm."""
        base = f"{self.tag}.w{index}g{generation}"
        made = []
        try:
            if reuse is None:
                made.append(Ring(base + ".sub", self.ring_capacity, create=True))
                made.append(Ring(base + ".wsub", self.ring_capacity, create=True))
                # Both submit rings may be full at once: the completion ring holds both.
                made.append(Ring(base + ".cpl", 2 * self.ring_capacity, create=True))
                made.append(WakeSemaphore(base + ".wake", create=True))
                read_ring, write_ring, completion_ring, wake = made
            else:
                read_ring, write_ring, completion_ring, wake = reuse
                for ring in (read_ring, write_ring, completion_ring):
                    ring.reset()
                wake.drain()
            row = self.control.workers[index]
            row[READY_PID] = 0
            # The reads the dead worker held were failed by the engine: none of them
            # is outstanding any more (workers.control: reads outstanding).
            row[READS_SUBMITTED] = 0
            row[READS_DONE] = 0
            # A worker killed inside a write never cleared its reservation; its
            # temp file, if any, is on disk for the evictor's scan to count.
            row[INFLIGHT] = 0
            row[INFLIGHT_KEY] = 0
            row[WANT] = 0  # nor its wait for room (workers.room)
            self.control.heartbeat[index] = 0
            spec = self.spec.bind(index=index, parent_pid=os.getpid(), read_ring=read_ring.name,
                                  write_ring=write_ring.name,
                                  completion_ring=completion_ring.name,
                                  completion_capacity=completion_ring.capacity,
                                  wake_sem=wake.name)
            # An fd-mapped pool (SGLang's memfds, which are CLOEXEC): hand exactly
            # those descriptors to the worker, at the same numbers.
            child = Child("workers.worker", f"hicache_mp-worker-{index}", spec.to_json(),
                          ready_word=lambda: row[READY_PID], pass_fds=spec.pool_fds())
        except BaseException:
            for r in made:
                r.close()
            raise
        handle = WorkerHandle(index, generation, child, read_ring, write_ring, completion_ring,
                              wake)
        self._handles.append(handle)
        if self.pin_cpus:
            self._pin(handle)
        return handle

    def _pin(self, handle: WorkerHandle) -> None:
        import psutil
        cpu = self.pin_cpus[handle.index % len(self.pin_cpus)]
        try:
            psutil.Process(handle.pid).cpu_affinity([cpu])
        except (psutil.Error, OSError, AttributeError):
            pass  # pinning is an optimisation, never a reason to fail

    def usable(self) -> list[WorkerHandle]:
        """Workers new work may go to: READY ones."""
        return [h for h in self.workers if h.state is S.READY]

    def dead(self) -> list[WorkerHandle]:
        """READY workers that have exited without being asked to. A waitpid each.
        (One that exits before it is ready is `poll_starting`'s to report.)"""
        if self.closed or self._broken is not None:
            return []
        return [h for h in self.workers if h.state is S.READY and not h.alive()]

    def kill_stuck(self, handle: WorkerHandle) -> None:
        """The watchdog gives up on READY `handle`: STUCK, SIGKILLed (no wait);
        `respawn` replaces it, and `reaped()` reports it once it is gone."""
        handle.to(S.STUCK)
        handle.child.kill()

    def respawn(self, handle: WorkerHandle) -> WorkerHandle | None:
        """Start a replacement for `handle` and return at once: READY and exited,
        STUCK or FAILED (killed), or REAPED (its replacement waited for that).

        The caller has drained the old completion ring and failed its pages. The
        replacement takes work once `poll_starting` has seen it ready. Raises
        BrokenPool (and the pool is broken) if it cannot even be launched.
        None: /dev/shm had no room for a killed worker's replacement's rings;
        `handle` is DYING_UNREPLACED, and `reaped()` returns it REAPED, to be
        passed here again, when its own rings are free to reuse.
        """
        self.check()
        if handle.state is S.FAILED:
            self._start_failures[handle.index] += 1
            if self._start_failures[handle.index] >= MAX_START_FAILURES:
                self._break(f"could not replace hicache_mp-worker-{handle.index}: "
                            f"{handle.start_error}")
                handle.close_rings()
                raise BrokenPool(self.broken)
        if handle.state in (S.STUCK, S.FAILED) and handle.alive():
            # Killed but not reaped: it may still map its rings, so new ones.
            # With /dev/shm full, the replacement waits for the reaping instead
            # and then reuses these (DYING_UNREPLACED, then REAPED).
            handle.child.kill()
            try:
                new = self._spawn(handle.index, handle.generation + 1)
            except ShmFullError:
                handle.to(S.DYING_UNREPLACED)
                return None
            except Exception as exc:
                handle.to(S.DYING)  # no successor, but reaped() still lifts its fence
                self._break(f"could not replace hicache_mp-worker-{handle.index}: {exc}")
                raise BrokenPool(self.broken) from exc
            handle.to(S.DYING)
            handle.close_rings()
            return self._install(new)
        # Killed ones are DYING until reaped() reports them (at once: alive()
        # below reaps), which is when the engine lifts their fence.
        then = S.DYING if handle.state in (S.STUCK, S.FAILED) else S.GONE
        if handle.alive():
            raise WorkerStateError(f"respawn of hicache_mp-worker-{handle.index}, "
                                   f"{handle.state.name} and still running")
        handle.check_move(then)
        # Reaped: the replacement owns its rings now, so it needs no new /dev/shm.
        reuse = None if handle.rings_closed else handle.hand_over_rings()
        if then is S.DYING:
            handle.to(S.DYING)
        else:
            self._gone(handle)
        try:
            new = self._spawn(handle.index, handle.generation + 1, reuse)
        except Exception as exc:
            if reuse is not None:
                for r in reuse:
                    r.close()
            self._break(f"could not replace hicache_mp-worker-{handle.index}: {exc}")
            raise BrokenPool(self.broken) from exc
        return self._install(new)

    def _install(self, new: WorkerHandle) -> WorkerHandle:
        self.workers[new.index] = new
        self.respawns += 1
        return new

    def _gone(self, handle: WorkerHandle) -> None:
        handle.to(S.GONE)
        try:
            self._handles.remove(handle)
        except ValueError:
            pass  # a close() from a signal handler has dropped every handle meanwhile

    def poll_starting(self) -> tuple[list[WorkerHandle], list[WorkerHandle]]:
        """(replacements READY now, replacements FAILED now).

        A FAILED one is killed and never usable; the caller fails its pages and
        calls `respawn` for it, which starts another or, after
        MAX_START_FAILURES in a row, breaks the pool."""
        ready, failed = [], []
        for h in self.starting:
            try:
                if not h.child.check_start(self.start_timeout_s):
                    continue
                h.to(S.READY)
                ready.append(h)
                self._start_failures[h.index] = 0
            except ChildStartError as exc:
                h.start_error = str(exc)
                h.child.kill()
                h.to(S.FAILED)
                failed.append(h)
        return ready, failed

    def reaped(self) -> list[WorkerHandle]:
        """Killed workers that are gone for good now (a waitpid each): DYING ones
        end GONE, DYING_UNREPLACED ones REAPED (the caller respawns those)."""
        gone = [h for h in self.dying if not h.alive()]
        for h in gone:
            if h.state is S.DYING:
                self._gone(h)
            else:
                h.to(S.REAPED)
        return gone

    def close(self, grace_s: float = STOP_GRACE_S) -> None:
        self.stop(grace_s)
        for h in self.workers:                             # 5
            h.close_rings()
        self.workers = []
        self._handles = []

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Steps 1-4: the workers are gone; their rings stay readable."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        self.control.words[STOP] = 1                       # 1
        for h in self.workers:                             # 2
            try:
                h.wake.post()
            except Exception:
                pass
        deadline = time.monotonic() + grace_s              # 3
        for h in self.workers + self.dying:
            h.child.stop(deadline)                         # 4

