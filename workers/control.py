"""The control block: one small shared segment the engine and all workers see.

Owns the fields that are not per-record traffic: the stop flag, the number of
threads blocked waiting for completions, each worker's ready pid and busy
counters, and the cancel table. Must not carry page records (rings do).

Every field is an aligned uint64, written by exactly one side:

    STOP, WAITERS                engine
    per worker: READY_PID, BUSY_NS, PAGES, BYTES      that worker
    CANCEL[op_id % CANCEL_SLOTS] = op_id              engine
"""
import numpy as np

from shm import Segment

MAX_WORKERS = 256
CANCEL_SLOTS = 4096
_WORKER_FIELDS = 4
STOP, WAITERS = 0, 1
_WORKERS_AT = 8
_CANCEL_AT = _WORKERS_AT + MAX_WORKERS * _WORKER_FIELDS
_TOTAL = _CANCEL_AT + CANCEL_SLOTS
READY_PID, BUSY_NS, PAGES, BYTES = range(_WORKER_FIELDS)


class Control:
    def __init__(self, name: str, *, create: bool):
        self.segment = Segment(name, _TOTAL * 8, create=create)
        self.words = np.frombuffer(self.segment.map, dtype=np.uint64, count=_TOTAL)
        self.workers = self.words[_WORKERS_AT:_CANCEL_AT].reshape(MAX_WORKERS, _WORKER_FIELDS)
        self.cancel_table = self.words[_CANCEL_AT:]

    @property
    def name(self) -> str:
        return self.segment.name

    def stopping(self) -> bool:
        return bool(self.words[STOP])

    def cancelled(self, op_id: int) -> bool:
        return self.cancel_table[op_id % CANCEL_SLOTS] == op_id

    def cancel(self, op_id: int) -> None:
        self.cancel_table[op_id % CANCEL_SLOTS] = op_id

    def close(self) -> None:
        del self.words, self.workers, self.cancel_table
        self.segment.close()
