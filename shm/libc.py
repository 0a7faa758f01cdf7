"""libc through ctypes: one loader for every module that calls it directly.

Owns how the process's libc is reached: its own symbols (`None`: libc on
Linux), never `ctypes.util.find_library`, which runs `ldconfig -p` in a
subprocess on the first call of what may be a hot path; errno kept for
ctypes.get_errno; each function's signature set once, on the first use.
Must not choose for a caller whether the GIL is held: the caller names the
kind, `ctypes.PyDLL` (the GIL kept across the call: for calls that never
block, made from the scheduler's threads, decision 74) or `ctypes.CDLL`
(released: for calls that may block).
"""
import ctypes
import functools


def loader(kind, signatures: dict):
    """A zero-argument function returning libc loaded as `kind` (ctypes.CDLL
    or ctypes.PyDLL), with `signatures` ({name: (restype, argtypes)}) set;
    loaded on its first call, the same object from then on."""
    @functools.cache  # C-level cache: a later call is one lookup, GIL held
    def lib():
        handle = kind(None, use_errno=True)
        for name, (restype, argtypes) in signatures.items():
            fn = getattr(handle, name)
            fn.restype = restype
            fn.argtypes = argtypes
        return handle
    return lib
