"""The busy scheduler loop that every benchmark's "busy" figure runs beside.

Owns the scheduler thread's own work between two polls of what it waits on,
for every bench and test that measures a busy scheduler: pure-Python work
that never gives the GIL up, as SGLang's and vLLM's scheduler loops hold it
while they build batches, which is what starves an in-process I/O thread.
Must not submit I/O, poll a queue, sleep or print: callers poll their own
system between steps and count steps and gaps around them.

One loop, three parameters a row keeps on purpose:

  kernel and step length         who                      why this one
  `scheduler_step`: poll(), then bench_prefetch,          a step as short as a poll (~10 µs):
    STEP_ITERS of `acc += i & 7` bench_quota, the         the loop rate then shows poll()'s
                                 GIL tests                own cost as well as the GIL's
  `lcg`: QUEUE_POLL_ITERS of an  the SGLang stack         SGLang's scheduler looks at its
    LCG between queue polls      harness (Scheduler)      queues between chunks of batch work
  `spin_for`: STEP_SPIN_S of     the vLLM tier bench,     vLLM's scheduler steps at ms scale:
    `book[n & 1023] = n`         bench_contention         one get_finished_jobs per 2 ms step

Each row's published loop rate (iterations/s, docs/results.md) is counted in
its own kernel's iterations, and a before/after comparison of a row holds
only if its kernel is unchanged: so the kernels stay as they were measured,
here once each. bench/sim/scheduler.py's reference scheduler is not a stand-in
loop: its per-step work is the real bookkeeping of its requests (modelled on
SGLang's event loop), and it polls the engine from that.
"""
import time

STEP_ITERS = 200          # `scheduler_step`'s bookkeeping: ~10 µs of interpreter work
QUEUE_POLL_ITERS = 256    # `lcg` iterations between two polls of SGLang's queues
STEP_SPIN_S = 0.002       # `spin_for` seconds between two polls of vLLM's tier


def scheduler_step(engine) -> int:
    """One iteration: poll (if there is an engine), then the bookkeeping."""
    if engine is not None:
        engine.poll()
    acc = 0
    for i in range(STEP_ITERS):  # ~10 µs of interpreter work, like a scheduler's batch bookkeeping
        acc += i & 7
    return acc


def idle_loop_rate(engine, seconds: float, ops) -> float:
    """Steps per second of the busy loop, step for step, with nothing in flight.

    `ops` are finished ops, so the loop's own "all done?" check costs the same
    as in the busy run it is the baseline of.
    """
    n, t0 = 0, time.perf_counter()
    deadline = t0 + seconds
    while not all(op.done and op.num_pages < 0 for op in ops):
        scheduler_step(engine)
        n += 1
        if time.perf_counter() > deadline:
            break
    return n / (time.perf_counter() - t0)


def lcg(x: int, n: int = QUEUE_POLL_ITERS) -> int:
    """`n` steps of a linear congruential generator from `x`; the last value."""
    for i in range(n):
        x = (x * 1103515245 + i) & 0xFFFFFFFF
    return x


def spin_for(seconds: float, book: dict) -> int:
    """Pure-Python bookkeeping for `seconds`; the iterations done. perf_counter and
    dict stores keep the GIL, so nothing here lets another thread run early."""
    end, n = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        book[n & 1023] = n
        n += 1
    return n


def spin_rate(seconds: float) -> float:
    """`spin_for`'s iterations per second over `seconds`, from a fresh book."""
    t0 = time.perf_counter()
    n = spin_for(seconds, {})
    return n / (time.perf_counter() - t0)
