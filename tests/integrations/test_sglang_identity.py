"""Two models served from one path never share pages (issue 33, finding 2; decision 91).

Containers serve every model as `--model-path /model`, and SGLang passes that
path as the model name. Here one directory holds a fine-tune, then (swapped
between two engine lifetimes, the same path) another one with different
weight files: through SGLang's real backend classes (StorageBackendFactory,
HiCacheStorageConfig, HiCacheMP) and through the engine's API, the second
finds none of the first's pages. Also: the name normalisation is injective,
the same weights at another path or a restart of the same model still share,
and an explicit `namespace` decides alone. Issue 47: a LoRA merged into the
middle of a weight file (bytes 8-16 MiB of 48 MiB; same config, names, size
and header) is another model (decision 106).
"""
import os
import shutil

import numpy as np
import pytest
import torch

try:
    import sglang.srt.mem_cache.hicache_storage as sgl_storage
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
except ImportError as exc:  # noqa: F841
    pytest.skip(f"SGLang is not importable ({exc}); install it with "
                f"`pip install --no-deps -r .ci/sglang-requirements.txt`", allow_module_level=True)

from sglang_pool import CpuMHAHostPool  # noqa: E402

from hicache_mp import EngineConfig, PageGeometry, PrefetchEngine  # noqa: E402
from hicache_mp.integrations.common import model_identity  # noqa: E402
from hicache_mp.integrations.sglang.names import SGLangShard  # noqa: E402

DYNAMIC = {"backend_name": "hicache_mp", "module_path": "hicache_mp.integrations.sglang",
           "class_name": "HiCacheMP", "interface_v1": 1, "allocator": "shm", "num_workers": 1}
KEYS = [f"p{i}" for i in range(3)]


def lay_model(path, seed, *, config=b'{"model_type": "llama"}'):
    """A model directory: config.json and two weight files of 200 KiB (the
    sample reads 3 x 64 KiB of each), contents from `seed`."""
    if os.path.exists(path):
        shutil.rmtree(path)
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "wb") as f:
        f.write(config)
    rng = np.random.default_rng(seed)
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        with open(os.path.join(path, name), "wb") as f:
            f.write(rng.bytes(200 << 10))


def backend(store, model, **extra):
    pool = CpuMHAHostPool(layout="layer_first", allocator_type="shm", pages=8)
    cfg = sgl_storage.HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name=model, extra_config={**DYNAMIC, "storage_dir": store, **extra})
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    b.register_mem_pool_host(pool)
    return b, pool


def serve(store, model, fill=None, **extra):
    """One server lifetime: (batch_exists, batch_get_v1, pages got), having
    first written KEYS from `fill` (a seed) when given."""
    b, pool = backend(store, model, **extra)
    try:
        if fill is not None:
            g = torch.Generator().manual_seed(fill)
            raw = pool.kv_buffer.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
            assert b.batch_set_v1(KEYS, pool.token_indices([0, 1, 2])) == [True] * 3
        pool.kv_buffer.zero_()
        n = b.batch_exists(KEYS)
        got = b.batch_get_v1(KEYS, pool.token_indices([3, 4, 5]))
        return n, got, pool.kv_buffer.clone()
    finally:
        b.close()
        pool.close()


def test_two_models_swapped_at_one_path_share_no_page(tmp_path):
    store, model = str(tmp_path / "store"), str(tmp_path / "model")
    lay_model(model, seed=1)
    assert serve(store, model, fill=7)[:2] == (3, [True] * 3)
    assert serve(store, model)[:2] == (3, [True] * 3)          # a restart: the same weights
    lay_model(model, seed=2)                                      # another fine-tune, same path
    n, got, kv = serve(store, model)
    assert (n, got) == (0, [False] * 3)
    assert not kv.any()                                           # no byte of the first model
    # back to the first weights: its pages are found again
    lay_model(model, seed=1)
    assert serve(store, model)[:2] == (3, [True] * 3)


def test_a_lora_merged_in_the_middle_of_a_weight_file_is_another_model(tmp_path):
    """Pod A serves the base model, pod B its LoRA merge, both at one path:
    one 48 MiB weight file whose bytes 8-16 MiB differ, nothing else. B gets
    none of A's 3 pages; a pod with its own copy of A's weights at that path
    (other inodes and mtimes) gets all 3."""
    store, model = str(tmp_path / "store"), str(tmp_path / "model")
    lay_model(model, seed=1)
    weights = os.path.join(model, "model-00001-of-00002.safetensors")
    with open(weights, "wb") as f:
        f.write(np.random.default_rng(11).bytes(48 << 20))
    assert serve(store, model, fill=9)[:2] == (3, [True] * 3)
    copy = str(tmp_path / "copy")
    shutil.copytree(model, copy)
    shutil.rmtree(model)
    shutil.copytree(copy, model)                                  # the same weights, copied
    assert serve(store, model)[:2] == (3, [True] * 3)
    with open(weights, "r+b") as f:                               # the merge, in place
        f.seek(8 << 20)
        f.write(np.random.default_rng(12).bytes(8 << 20))
    n, got, kv = serve(store, model)
    assert (n, got) == (0, [False] * 3) and not kv.any()


def test_a_new_config_alone_is_another_model(tmp_path):
    store, model = str(tmp_path / "store"), str(tmp_path / "model")
    lay_model(model, seed=1)
    serve(store, model, fill=3)
    lay_model(model, seed=1, config=b'{"model_type": "llama", "rope_theta": 1}')
    assert serve(store, model)[:2] == (0, [False] * 3)


def test_an_explicit_namespace_decides_alone(tmp_path):
    store, model = str(tmp_path / "store"), str(tmp_path / "model")
    lay_model(model, seed=1)
    serve(store, model, fill=5, namespace="team-a/llama-ft-3")
    lay_model(model, seed=2)
    assert serve(store, model, namespace="team-a/llama-ft-3")[:2] == (3, [True] * 3)
    assert serve(store, model, namespace="team-a/llama-ft-4")[:2] == (0, [False] * 3)


def test_model_names_stay_apart_and_hub_ids_carry_their_revision():
    one, other = SGLangShard("acme/llama-8b"), SGLangShard("acme-llama/8b")
    assert one.file_suffix == other.file_suffix                   # SGLang's own names collide
    assert one.engine_names()["model_name"] != other.engine_names()["model_name"]
    assert model_identity("acme/llama-8b", revision="v1") != \
        model_identity("acme/llama-8b", revision="v2")
    assert model_identity("a|b") != model_identity("a", served_name="b")


def test_engine_api_namespaces_of_two_weights_at_one_path_share_no_page(tmp_path):
    """The same rule for a program on the engine's API: the identity goes into
    namespace_extra, and `model_name` may hold any characters."""
    store, model = str(tmp_path / "store"), str(tmp_path / "model")
    g = PageGeometry(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4)

    def engine():
        return PrefetchEngine(EngineConfig(storage_dir=store, num_workers=1, host_pool_pages=4,
                                           model_name=model,
                                           namespace_extra=model_identity(model)), g)
    lay_model(model, seed=1)
    with engine() as e:
        e.host_pool.segment.map[:g.page_bytes] = b"\x11" * g.page_bytes
        op = e.backup(KEYS[:1], [0])
        assert e.wait(op, 30) and op.status == "ok"
    lay_model(model, seed=2)
    with engine() as e:
        assert e.exists(KEYS[:1], wait_s=2.0) == 0
        op = e.prefetch(KEYS[:1], [1])
        assert e.wait(op, 30) and op.status_counts() == {"miss": 1}
    # a model name holding the separator cannot pass for another name and extra
    def plain(name, extra):
        return PrefetchEngine(EngineConfig(storage_dir=store, num_workers=1, host_pool_pages=2,
                                           model_name=name, namespace_extra=extra), g)
    with plain("m", "") as e:
        fp = e.namespace.split("|")[2]
    with plain(f"m|tp0of1|{fp}|e", "") as a, plain("m", f"e|tp0of1|{fp}|") as b:
        assert a.namespace != b.namespace
        op = a.backup(KEYS[:1], [0])
        assert a.wait(op, 30) and op.status == "ok"
        assert b.exists(KEYS[:1], wait_s=2.0) == 0
