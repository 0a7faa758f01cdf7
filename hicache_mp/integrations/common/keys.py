"""Framework keys as engine keys, and the leading-run answers frameworks expect.

SGLang's keys are hex strings already; vLLM's OffloadKey is raw bytes (a block
hash and a 4-byte group index) that may hold NUL, '/' or '..', which the engine
refuses in a key (workers.naming.check_key), so bytes become their hex text: one
C call per key, no per-byte Python. The engine checks every key it is given
(ValueError before anything reaches a worker); this module adds no rule of its
own. Must not hash or touch the store.
"""


def engine_key(key) -> str:
    """`key` as the engine's key: str as is, bytes-like as lowercase hex."""
    if isinstance(key, str):
        return key
    if isinstance(key, (bytes, bytearray, memoryview)):
        return bytes(key).hex()
    raise ValueError(f"a key must be str or bytes, got {type(key).__name__}")


def engine_keys(keys) -> list[str]:
    """`engine_key` of each key, as a list (str keys are passed through uncopied)."""
    out = []
    for key in keys:
        out.append(key if type(key) is str else engine_key(key))
    return out


def leading(n: int, total: int) -> list[bool]:
    """One bool per key for a leading run of `n` of `total` (no per-key Python)."""
    return [True] * n + [False] * (total - n)
