"""Bool-mask steps for the vLLM tier's jobs, on vLLM's scheduler thread.

Each keeps the GIL (shm.gilkeep: numpy's loops over more than 500 elements
let it go), in chunks of gilkeep.CHUNK. Must not know about jobs or the engine.
"""
import numpy as np

from shm import gilkeep


def either(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = gilkeep.zeros(len(a), bool)
    for i in range(0, len(a), gilkeep.CHUNK):
        np.logical_or(a[i:i + gilkeep.CHUNK], b[i:i + gilkeep.CHUNK], out=out[i:i + gilkeep.CHUNK])
    return out


def equal(a: np.ndarray, value) -> np.ndarray:
    out = gilkeep.zeros(len(a), bool)
    for i in range(0, len(a), gilkeep.CHUNK):
        np.equal(a[i:i + gilkeep.CHUNK], value, out=out[i:i + gilkeep.CHUNK])
    return out


def where(mask: np.ndarray, value: bool) -> np.ndarray:
    """Positions where `mask` is `value`, as int64."""
    parts = [np.flatnonzero(mask[i:i + gilkeep.CHUNK] == value) + i
             for i in range(0, len(mask), gilkeep.CHUNK)]
    return gilkeep.concat(parts, np.int64)
