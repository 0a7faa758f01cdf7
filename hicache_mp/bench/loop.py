"""The busy scheduler loop that every benchmark's "busy" figure runs beside.

Owns one step of a pure-Python scheduler: poll the engine, then about 10 µs
of interpreter work standing for a scheduler's batch bookkeeping. It holds
the GIL as SGLang's and vLLM's scheduler loops do, which is what starves an
in-process I/O thread. Must not time, sleep or wait: callers count steps and
gaps around it.
"""


def scheduler_step(engine) -> int:
    """One iteration: poll (if there is an engine), then the bookkeeping."""
    if engine is not None:
        engine.poll()
    acc = 0
    for i in range(200):  # ~10 µs of interpreter work, like a scheduler's batch bookkeeping
        acc += i & 7
    return acc
