"""The weights' fingerprint (hicache_mp.integrations.common.identity, decision 106).

Issue 47: a fine-tune that merges a LoRA into some tensors changes only those
bytes (same config, names, sizes, safetensors header). The fingerprint read
the first, middle and last 64 KiB of each file, so a 48 MiB file whose bytes
8-16 MiB changed had the base model's fingerprint, and a server of the
fine-tune at the same path was handed the base model's KV pages. Now it reads
4 KiB at every multiple of 1 MiB (and the last 4 KiB, and a safetensors
file's whole header): a changed run of 1 MiB or more anywhere is seen, and the
same weights copied or rewritten are still the same weights.

Real files; the last test runs real engines (workers, a store) on the
engine's API, no framework needed (the SGLang path: test_sglang_identity.py).

Reaches inside: identity's `_file_digest` (wrapped to count the files whose
fingerprint was computed rather than remembered: no public call says which).
"""
import json
import os
import shutil
import struct

import numpy as np

from hicache_mp import EngineConfig, PageGeometry, PrefetchEngine
from hicache_mp.integrations.common import identity, model_identity
from hicache_mp.integrations.common.identity import SAMPLE, STRIDE, sample_offsets, \
    weights_fingerprint

MiB = 1 << 20


def safetensors(path, size: int, seed: int = 1, header: dict | None = None) -> None:
    """A file shaped as a safetensors file: its 8-byte length, a JSON header,
    then random bytes up to `size`."""
    head = json.dumps(header or {"w": {"dtype": "BF16", "shape": [8], "data_offsets": [0, 16]}})
    head = head.encode() + b" " * (-(8 + len(head)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        f.write(np.random.default_rng(seed).bytes(size - 8 - len(head)))


def model_dir(path, size: int = 48 * MiB, seed: int = 1) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write('{"model_type": "llama"}')
    safetensors(os.path.join(path, "model.safetensors"), size, seed)
    return str(path)


def change(path, start: int, length: int) -> None:
    """Every byte of [start, start + length) flipped, in place (the size stays)."""
    with open(path, "r+b") as f:
        f.seek(start)
        old = f.read(length)
        f.seek(start)
        f.write(bytes(b ^ 0xFF for b in old) if length < MiB else
                (np.frombuffer(old, np.uint8) ^ 0xFF).tobytes())


def test_a_lora_merged_into_the_middle_of_a_file_is_another_model(tmp_path):
    # The case: 48 MiB, bytes 8-16 MiB changed; config, names, size and
    # header the same, the first, middle and last 64 KiB untouched.
    model = model_dir(tmp_path / "m")
    weights = os.path.join(model, "model.safetensors")
    base = model_identity(model)
    change(weights, 8 * MiB, 8 * MiB)
    assert model_identity(model) != base


def test_any_changed_run_of_a_stride_anywhere_is_seen(tmp_path):
    """A run of STRIDE bytes holds a multiple of STRIDE, whose sample reads it:
    starts at and around sample points, mid-stride, the file's last bytes."""
    size = 8 * MiB + 12345
    path = str(tmp_path / "w.safetensors")
    safetensors(path, size)
    base = weights_fingerprint(path)
    rng = np.random.default_rng(7)
    starts = [0, 1, SAMPLE - 1, SAMPLE, STRIDE - 1, STRIDE, STRIDE + SAMPLE, 3 * MiB + 777,
              7 * MiB + 1, size - STRIDE - 1, size - STRIDE]
    starts += [int(x) for x in rng.integers(0, size - STRIDE, 12)]
    for start in starts:
        change(path, start, STRIDE)
        assert weights_fingerprint(path) != base, f"a run at {start} went unseen"
        change(path, start, STRIDE)      # flipped back: the same bytes, the same fingerprint
        assert weights_fingerprint(path) == base


def test_small_files_are_read_whole_and_the_header_counts(tmp_path):
    path = str(tmp_path / "adapter.safetensors")
    safetensors(path, 700 << 10)
    base = weights_fingerprint(path)
    change(path, 300 << 10, 1)           # one byte of a file of at most STRIDE
    assert weights_fingerprint(path) != base
    # a larger file whose header alone differs (a tensor renamed; same length)
    big = str(tmp_path / "big.safetensors")
    tensor = {"dtype": "BF16", "shape": [8], "data_offsets": [0, 16]}
    safetensors(big, 5 * MiB, header={"a": tensor})
    one = weights_fingerprint(big)
    safetensors(big, 5 * MiB, header={"b": tensor})
    assert weights_fingerprint(big) != one


def test_the_samples_and_what_they_cost():
    assert sample_offsets(3 * MiB) == [0, MiB, 2 * MiB, 3 * MiB - SAMPLE]
    # a sample point closer to the end than SAMPLE is moved back, still holding it
    end = 2 * MiB + 100 - SAMPLE
    assert sample_offsets(2 * MiB + 100) == [0, MiB, end, end]
    # 16 GiB: 16,385 samples, 64 MiB read (0.4%)
    n = len(sample_offsets(16 << 30))
    assert n == 16385 and n * SAMPLE <= (16 << 30) // 250


def test_the_same_weights_copied_or_rewritten_share_one_identity(tmp_path):
    model = model_dir(tmp_path / "a", size=6 * MiB)
    base = model_identity(model)
    copy = str(tmp_path / "elsewhere" / "b")
    shutil.copytree(model, copy)                       # another path, inode, mtime
    assert model_identity(copy) == base
    weights = os.path.join(model, "model.safetensors")
    data = open(weights, "rb").read()
    os.unlink(weights)
    with open(weights, "wb") as f:                     # rewritten: a new inode
        f.write(data)
    os.utime(weights, ns=(1, 1))                       # any mtime
    assert model_identity(model) == base
    # however many threads read it
    assert weights_fingerprint(model, readers=1) == weights_fingerprint(model, readers=5) == \
        weights_fingerprint(model, readers=32)


def test_the_memo_holds_settled_files_only(tmp_path, monkeypatch):
    path = str(tmp_path / "w.safetensors")
    safetensors(path, 3 * MiB)
    computed = []
    real = identity._file_digest
    monkeypatch.setattr(identity, "_file_digest",
                        lambda *a: computed.append(a[0]) or real(*a))
    identity.forget()
    weights_fingerprint(path)
    weights_fingerprint(path)
    assert len(computed) == 2                           # written just now: not remembered
    monkeypatch.setattr(identity, "RECENT_S", 0.0)      # as if written long ago
    base = weights_fingerprint(path)
    assert weights_fingerprint(path) == base and len(computed) == 3   # remembered
    change(path, MiB, STRIDE)                           # a new ctime (and mtime): computed again
    assert weights_fingerprint(path) != base and len(computed) == 4
    identity.forget()


def test_two_engines_of_a_base_model_and_its_lora_merge_at_one_path_share_no_page(tmp_path):
    """Real engines and a real store on the engine's API, as an adapter makes
    them: the identity in namespace_extra. The base model's pages are found
    by a restart and by a copy of its weights at another path, and not by its
    fine-tune at the same path."""
    store, model = str(tmp_path / "store"), str(tmp_path / "model")
    g = PageGeometry(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4)
    keys = [f"p{i}" for i in range(3)]

    def engine(path):
        return PrefetchEngine(EngineConfig(storage_dir=store, num_workers=1, host_pool_pages=6,
                                           model_name="/model",
                                           namespace_extra=model_identity(path)), g)

    def found(path) -> int:
        with engine(path) as e:
            op = e.prefetch(keys, [3, 4, 5])
            assert e.wait(op, 30)
            return op.status_counts().get("ok", 0)

    model_dir(model)
    with engine(model) as e:
        n = 3 * g.page_bytes
        e.host_pool.segment.map[:n] = np.random.default_rng(3).bytes(n)
        op = e.backup(keys, [0, 1, 2])
        assert e.wait(op, 30) and op.status == "ok"
    assert found(model) == 3                            # a restart of the same weights
    shutil.copytree(model, str(tmp_path / "copy"))
    assert found(str(tmp_path / "copy")) == 3           # the same weights elsewhere
    change(os.path.join(model, "model.safetensors"), 8 * MiB, 8 * MiB)
    assert found(model) == 0                            # the fine-tune: none of the base's pages
