"""Waiting for an op on a caller's thread, with a deadline after which it is abandoned.

A framework that reuses its host slots as soon as a call returns (SGLang's
synchronous batch_get/batch_set, vLLM's drain_jobs) must not return while a
worker could still write them: past the deadline the op is abandoned, which
returns only once nothing can (a stuck worker is killed and replaced). Must
not spin: `engine.wait` sleeps with the GIL released.
"""
from workers.timing import ABANDON_GRACE_S


def wait_or_abandon(engine, op, timeout_s: float | None) -> bool:
    """Block until `op` is done (True). With a finite `timeout_s`, past it the
    op is abandoned (its pages not done end cancelled or worker_died) and this
    returns False once no worker can write its slots any more."""
    if timeout_s is None:
        engine.wait(op)
        return True
    if engine.wait(op, timeout_s):
        return True
    engine.abandon(op, grace_s=min(ABANDON_GRACE_S, timeout_s))
    return False
