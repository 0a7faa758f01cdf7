"""WorkerPool: starts, watches, replaces and stops the I/O worker processes.

    engine (scheduler process)                 worker i  (python -m workers.worker)
    --------------------------                 ------------------------------------
    submit_ring[i].push(reads) -------------->  pop, do I/O into/out of the pool
    write_ring[i].push(writes) -------------->    (reads first: workers.worker)
    wake[i].post()  (once per batch)              (sleeps on wake[i] when idle)
    completion_ring[i].pop()  <---------------  push completion, post done if WAITERS
    check(): a dead worker is reported,         exits on STOP or when its parent dies
             then respawned with fresh rings

Owns process lifecycle and the per-worker rings and wake semaphore. Must not
interpret records: the engine does that. Workers are launched through
`subprocess` (spawn semantics: fresh interpreter, no CUDA state, no inherited
locks), which also works from a daemonic multiprocessing parent.

Shutdown protocol (close()):
  1. set STOP in the control block;
  2. post every worker's wake semaphore, so sleepers see STOP at once;
  3. wait up to `grace_s` for every worker to exit;
  4. SIGKILL stragglers and reap them;
  5. close and unlink every ring and semaphore the pool created.
"""
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from shm import Ring, WakeSemaphore
from workers.control import MAX_WORKERS, READS_DONE, READS_SUBMITTED, READY_PID, STOP, Control

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


class WorkerStartError(RuntimeError):
    """A worker could not be started (it exited or never became ready)."""


class BrokenPool(RuntimeError):
    """The pool is closed or could not replace a dead worker."""


@dataclass
class WorkerHandle:
    index: int
    generation: int
    proc: subprocess.Popen
    submit: Ring          # reads (prefetch)
    write: Ring           # writes (backup): served after reads
    completion: Ring
    wake: WakeSemaphore

    @property
    def rings(self) -> tuple:
        return (self.submit, self.write, self.completion, self.wake)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None


class WorkerPool:
    def __init__(self, *, num_workers: int, tag: str, control: Control, done_sem: str,
                 worker_config: dict, ring_capacity: int, pin_cpus: list[int] | None = None,
                 start_timeout_s: float = 60.0):
        if not 1 <= num_workers <= MAX_WORKERS:
            raise ValueError(f"num_workers must be in [1, {MAX_WORKERS}], got {num_workers}")
        self.tag = tag
        self.control = control
        self.done_sem = done_sem
        self.base_config = worker_config
        self.ring_capacity = ring_capacity
        self.pin_cpus = pin_cpus
        self.start_timeout_s = start_timeout_s
        self.respawns = 0
        self.workers: list[WorkerHandle] = []
        self.closed = False
        try:
            for i in range(num_workers):
                self.workers.append(self._spawn(i, 0))
            self._wait_ready(self.workers)
        except BaseException:
            self.close()
            raise

    def __len__(self) -> int:
        return len(self.workers)

    # --- lifecycle ----------------------------------------------------------
    def _spawn(self, index: int, generation: int) -> WorkerHandle:
        base = f"{self.tag}.w{index}g{generation}"
        made = []
        try:
            made.append(Ring(base + ".sub", self.ring_capacity, create=True))
            made.append(Ring(base + ".wsub", self.ring_capacity, create=True))
            # Both submit rings may be full at once: the completion ring holds both.
            made.append(Ring(base + ".cpl", 2 * self.ring_capacity, create=True))
            made.append(WakeSemaphore(base + ".wake", create=True))
        except BaseException:
            for r in made:
                r.close()
            raise
        submit, write, completion, wake = made
        self.control.workers[index][READY_PID] = 0
        # The reads the dead worker held were failed by the engine: none of them
        # is outstanding any more (workers.control: reads outstanding).
        self.control.workers[index][READS_SUBMITTED] = 0
        self.control.workers[index][READS_DONE] = 0
        cfg = dict(self.base_config, index=index, parent_pid=os.getpid(),
                   submit_ring=submit.name, write_ring=write.name, completion_ring=completion.name,
                   ring_capacity=self.ring_capacity, completion_capacity=completion.capacity,
                   wake_sem=wake.name, done_sem=self.done_sem, control=self.control.name)
        cfg["orphan_unlink_shm"] = [cfg["pool_name"], cfg["control"], submit.name, write.name,
                                    completion.name]
        cfg["orphan_unlink_sem"] = [wake.name, self.done_sem]
        # Names of the engine's other helpers (the evictor's ring and semaphore).
        cfg["orphan_unlink_shm"] += cfg.pop("orphan_extra_shm", [])
        cfg["orphan_unlink_sem"] += cfg.pop("orphan_extra_sem", [])
        env = dict(os.environ)
        env["PYTHONPATH"] = _PACKAGE_ROOT + os.pathsep + env.get("PYTHONPATH", "")
        try:
            # pool_fd (an fd-mapped pool such as SGLang's memfd, which is CLOEXEC):
            # hand exactly that descriptor to the worker, at the same number.
            pass_fds = (cfg["pool_fd"],) if cfg.get("pool_fd") is not None else ()
            proc = subprocess.Popen(
                [sys.executable, "-m", "workers.worker", f"hicache_mp-worker-{index}", json.dumps(cfg)],
                env=env, stdin=subprocess.DEVNULL, close_fds=True, pass_fds=pass_fds)
        except BaseException:
            for r in made:
                r.close()
            raise
        handle = WorkerHandle(index, generation, proc, submit, write, completion, wake)
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

    def _wait_ready(self, handles: list[WorkerHandle]) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        pending = list(handles)
        while pending:
            for h in list(pending):
                if int(self.control.workers[h.index][READY_PID]) == h.pid:
                    pending.remove(h)
                elif not h.alive():
                    raise WorkerStartError(
                        f"hicache_mp-worker-{h.index} exited with code {h.proc.returncode} "
                        f"before it was ready (see its stderr above)")
            if pending and time.monotonic() > deadline:
                raise WorkerStartError(f"{len(pending)} worker(s) not ready after {self.start_timeout_s}s")
            if pending:
                time.sleep(0.002)

    def dead(self) -> list[WorkerHandle]:
        """Workers that have exited without being asked to. A waitpid per worker."""
        if self.closed:
            return []
        return [h for h in self.workers if not h.alive()]

    def respawn(self, handle: WorkerHandle) -> WorkerHandle:
        """Replace a dead worker. The caller has drained its completion ring."""
        if self.closed:
            raise BrokenPool("pool is closed")
        for r in handle.rings:
            r.close()
        new = self._spawn(handle.index, handle.generation + 1)
        self.workers[handle.index] = new
        self.respawns += 1
        try:
            self._wait_ready([new])
        except WorkerStartError as exc:
            raise BrokenPool(f"could not replace hicache_mp-worker-{handle.index}: {exc}") from exc
        return new

    def close(self, grace_s: float = 2.0) -> None:
        self.stop(grace_s)
        for h in self.workers:                             # 5
            for r in h.rings:
                r.close()
        self.workers = []

    def stop(self, grace_s: float = 2.0) -> None:
        """Steps 1-4: the workers are gone; their rings stay readable."""
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
        for h in self.workers:
            try:
                h.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                h.proc.kill()                              # 4
                h.proc.wait()
