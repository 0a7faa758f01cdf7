"""`sglang-fs-linker` 0.1.0 made loadable on SGLang 0.5.23, with the fewest changes.

`sglang-fs-linker` 0.1.0 (PyPI, Apache-2.0, pure Python) is the only file-based
`UnifiedCacheLinker`: one `torch.save` file per KV page, written and read
synchronously on the scheduler thread, TP=DP=PP=CP=1 only. It was written
against SGLang revision 9f417bd (the out-of-tree linker loader) and does not
load on SGLang 0.5.23. Its code is NOT in this repository: it is downloaded
into the gitignored `.whl-fslinker/` at the repository root

    pip download --no-deps sglang-fs-linker==0.1.0 -d .whl-fslinker/

and installed (`pip install --no-deps .whl-fslinker/*.whl`, what a device
run does; the wheel is pure Python). Nothing of the
package is changed or copied; `FsLinkerCompat` subclasses its
`sglang_fs_linker.linker.FileSystemLinker` and adds only what 0.5.23 requires:

1. `__init__` accepts `forward_stream` and stores it. 0.5.23's factory always
   passes `forward_stream=` to a "dynamic" linker; the package's constructor
   has no such parameter (TypeError). It is stored, not used: the package's
   `offload` calls `torch.cuda.synchronize(device)` before reading the pages,
   which waits for every stream on the device, the forward stream included,
   so `record_offload_ready()` gating is not needed for correctness.
2. `finish_layer_wise_loading(counter_index)` is implemented (abstract in
   0.5.23, absent in the package, so the factory refuses the class as abstract).
   The package does not use SGLang's `LayerWiseLoadCounter`: its
   `start_layer_wise_loading` copies every page of every layer and synchronizes
   the device before it returns the index (its counter's `wait_until` is a
   no-op), and raises on any failure. So by the time `finish` is called all
   layers have landed and it returns True. It also clears `completed_loads`:
   0.5.23 reports loads through `finish` and no longer calls the package's
   `num_completed_loads`/`pop_completed_load`, so without this the package
   would keep one list of rids per loaded batch for the life of the server.
3. `offload(transfers, session_id=None)` accepts and ignores `session_id`.
   0.5.23's `UnifiedCacheLinkerWrapper._offload_node` calls
   `offload(transfers, session_id=...)`; the package's `offload(transfers)`
   would raise TypeError on the first write-through.

Nothing else is changed: lookup, load, start_layer_wise_loading,
cancel_queued_load, the offload body, reset and close are the package's.

Config (launch):
    --enable-unified-cache-external-linker
    --unified-cache-external-linker-config '{"linker": "FsLinkerCompat",
        "linker_module_path": "fs_linker_compat",
        "linker_extra_config": {"directory": "/tmp/fs-kv", "namespace": "qwen3-0.6b-v1"}}'
with `scripts/device` on PYTHONPATH. The package's constructor reads exactly
two `linker_extra_config` keys, both required non-empty strings, and rejects
any other key: `directory` (files go under directory/<sha256 of namespace,
model_path, page_size, buffer dtypes/shapes>/<sha256 of page key>.pt) and
`namespace` (must change with weights/revision/LoRA/RoPE). It also reads
`get_parallel().tp_size/dp_size/dcp_size`, `params.pp_size/attn_cp_size/
page_size/mtp_draft_device_pools/is_eagle`, `get_model().model_path`, and the
KV pool from `params.token_to_kv_pool_allocator.get_kvcache()`.

Limits that stay (the package's, not changed here): components must be exactly
{FULL} with a plain `MHATokenToKVPool` in NHD layout and fp16/bf16/fp32 KV (no
SWA/Mamba/MLA, no quantized KV, no speculative decoding); TP=DP=PP=CP=DCP=1;
every load and offload is synchronous on the scheduler thread, stages each page
through CPU tensors and synchronizes the whole device; a page that goes missing
or is corrupt between lookup and load raises in `start_layer_wise_loading`
(crashing the scheduler) instead of failing the load; no eviction or capacity
limit. Its load counter has no `consumer_index`/`num_layers`, which only
0.5.23's *full* prefill CUDA-graph backend (`cuda_graph_config.prefill.backend
= full`, not the default breakable one) reads.

Device run: the wheel is pure Python (py3-none-any, Root-Is-Purelib: true;
only sglang_fs_linker/{__init__,linker,verify}.py, 13,725 bytes, sha256
4c075946c8bb719f33473d30300bfb2a71ec9e8b432c1ae72e114c83f072b324), so it
travels as is: pass `carry=[".whl-fslinker"]` to the device tool and start the
command with `pip install --no-deps .whl-fslinker/*.whl` (the box has no
network; the package's only dependency, `requests`, is for its verify script,
not the linker). Then `PYTHONPATH=scripts/device:$PYTHONPATH` so the factory
finds `fs_linker_compat`; without the install step this module falls back to
the carried wheel itself. SGLang 0.5.23 is not part of this: a server run
needs a full SGLang 0.5.23 on the box (device_deps.sh's stripped copy is only
for the import chain), and the linker is then selected with the config above.
Not run on a GPU yet: the CUDA branch (`torch.cuda.synchronize`, `.to(device)`)
is only exercised on the device.

`python scripts/device/fs_linker_compat.py --selfcheck` builds it through
SGLang's own factory on a real CPU `MHATokenToKVPool` and checks a
store -> lookup -> load round trip byte for byte, once driving the linker
directly and once through a real `UnifiedRadixCache` (see `_selfcheck`).
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

PACKAGE_VERSION = "0.1.0"
WHEEL_DIR = Path(__file__).resolve().parents[2] / ".whl-fslinker"


def _import_package():
    """The installed package, else the wheel in .whl-fslinker (pure Python)."""
    try:
        import sglang_fs_linker.linker as linker
    except ModuleNotFoundError as error:
        if error.name != "sglang_fs_linker":
            raise  # a dependency of the package (sglang, torch): do not mask it
        raise ModuleNotFoundError(
            f"sglang_fs_linker {PACKAGE_VERSION} is not installed: pip download --no-deps "
            f"sglang-fs-linker=={PACKAGE_VERSION} -d {WHEEL_DIR}, then pip install --no-deps "
            f"{WHEEL_DIR}/*.whl") from error
    from importlib.metadata import version

    found = version("sglang-fs-linker")
    if found != PACKAGE_VERSION:
        raise ImportError(f"fs_linker_compat wraps sglang-fs-linker {PACKAGE_VERSION}, found {found}")
    return linker


def _torchvision_placeholder() -> bool:
    """SGLang 0.5.23's mem_cache import chain imports torchvision (image model
    configs); this CPU box has none that matches torch 2.13+cpu. As in
    hicache_mp/bench/sglang/real.py (lab decision 32), answer those imports with
    placeholders only when `import torchvision` fails; no KV code calls them."""
    try:
        import torchvision  # noqa: F401
        return False
    except Exception:
        for name in [n for n in sys.modules if n.split(".")[0] == "torchvision"]:
            del sys.modules[name]
    import importlib.abc
    import importlib.machinery
    import types

    class Meta(type):
        def __getattr__(cls, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return Any

    class Any(metaclass=Meta):
        def __init__(self, *a, **k):
            pass

        def __call__(self, *a, **k):
            return Any()

        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return Any()

    class Module(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return Any

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname, path, target=None):
            if fullname.split(".")[0] == "torchvision":
                return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            return None

        def create_module(self, spec):
            module = Module(spec.name)
            module.__path__ = []
            module.__version__ = "0.0.0"  # turns transformers' torchvision paths off
            return module

        def exec_module(self, module):
            pass

    sys.meta_path.insert(0, Finder())
    return True


# Only a direct run (the CPU self-check) needs it, before the package imports sglang;
# a server importing this module by name never installs it.
TORCHVISION_PLACEHOLDER = __name__ == "__main__" and _torchvision_placeholder()
FileSystemLinker = _import_package().FileSystemLinker


class FsLinkerCompat(FileSystemLinker):
    """FileSystemLinker 0.1.0 with SGLang 0.5.23's constructor and interface."""

    def __init__(self, server_args, params, *, components, extra_config, forward_stream=None):
        super().__init__(server_args, params, components=components, extra_config=extra_config)
        self.forward_stream = forward_stream  # change 1

    def finish_layer_wise_loading(self, counter_index: int) -> bool:  # change 2
        # start_layer_wise_loading copied and synchronized every layer (or raised).
        self.completed_loads.clear()
        return True

    def offload(self, transfers, session_id=None):  # change 3
        return super().offload(transfers)


# --- self-check (CPU) ---------------------------------------------------------------
def _selfcheck() -> int:
    """Part 1 drives the linker the way UnifiedCacheLinkerWrapper does (offload ->
    lookup -> load -> start_layer_wise_loading -> wait_until per layer ->
    finish_layer_wise_loading) on a real CPU MHATokenToKVPool; part 2 runs the
    same round trip through a real UnifiedRadixCache (insert's write-through,
    flush, match_prefix, init_load_back, ready_to_load_host_cache,
    finish_external_linker_loads). Both compare the loaded slots byte for byte."""
    import logging
    import shutil
    import tempfile
    from array import array
    from types import SimpleNamespace

    import torch

    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import (
        InitLoadBackParams,
        InsertParams,
        MatchPrefixParams,
    )
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_cache.linker_factory import (
        create_unified_cache_linker,
        get_startup_linker_config,
    )
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    from sglang.srt.runtime_context import get_context, get_server_args

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    # The factory imports linker_module_path "fs_linker_compat" by name, as a server does:
    # scripts/device must be on PYTHONPATH (as scripts/device/device_linker.sh sets it).
    importlib.import_module("fs_linker_compat")

    layers, heads, head_dim, page, pages, dtype = 4, 2, 8, 4, 3, torch.bfloat16
    failures, compared = [], [0, 0]

    def check(ok, what):
        print(("ok   " if ok else "FAIL ") + what)
        if not ok:
            failures.append(what)

    def compare(part, pool, slots, expected):
        for layer in range(layers):
            got = (pool.get_key_buffer(layer)[slots], pool.get_value_buffer(layer)[slots])
            for name, have, want in zip("KV", got, expected[layer]):
                size = want.numel() * want.element_size()
                same = torch.equal(have.view(torch.uint8), want.view(torch.uint8))
                compared[part] += size if same else 0
                check(same, f"part {part + 1} layer {layer} {name}: {size} bytes equal")

    def fill(pool, slots, seed):
        generator = torch.Generator().manual_seed(seed)
        for buffer in (*pool.k_buffer, *pool.v_buffer):
            buffer[slots] = torch.randn((len(slots), heads, head_dim), generator=generator).to(dtype)
        return [(k[slots].clone(), v[slots].clone()) for k, v in zip(pool.k_buffer, pool.v_buffer)]

    directory = tempfile.mkdtemp(prefix="fs-linker-selfcheck-")
    config = {"linker": "FsLinkerCompat", "linker_module_path": "fs_linker_compat",
              "linker_extra_config": {"directory": directory, "namespace": "selfcheck-v1"}}
    # ServerArgs published the way SGLang's unit tests do it (TP=DP=PP=1, no server).
    with get_context().override_server_args(
        model_path="fs-linker-selfcheck", page_size=page,
        enable_unified_cache_external_linker=True,
        unified_cache_external_linker_config=config,
    ):
        server_args = get_server_args()
        check(get_startup_linker_config() == config, "launch config read back by get_startup_linker_config")
        pool = MHATokenToKVPool(size=16 * page, page_size=page, dtype=dtype, head_num=heads,
                                head_dim=head_dim, layer_num=layers, device="cpu",
                                enable_memory_saver=False, enable_alt_stream=False)
        allocator = PagedTokenToKVPoolAllocator(16 * page, page, dtype, "cpu", pool, need_sort=False)
        params = CacheInitParams(
            disable=False, token_to_kv_pool_allocator=allocator, page_size=page,
            req_to_token_pool=ReqToTokenPool(size=4, max_context_len=16 * page, device="cpu",
                                             enable_memory_saver=False),
            tree_components=(ComponentType.FULL,))

        def build(linker_config, **kwargs):
            return create_unified_cache_linker(server_args, params, backend="dynamic",
                                               config=linker_config,
                                               components={ComponentType.FULL}, **kwargs)

        # Each change is needed: the package's class as it is fails three ways on 0.5.23.
        try:
            build({**config, "linker": "FileSystemLinker", "linker_module_path": "sglang_fs_linker.linker"})
            check(False, "original FileSystemLinker refused by the 0.5.23 factory")
        except ValueError as error:
            print(f"     {error}")
            check("finish_layer_wise_loading" in str(error),
                  "original FileSystemLinker refused by the 0.5.23 factory (change 2)")
        only_finish = type("OnlyFinish", (FileSystemLinker,), {"finish_layer_wise_loading": lambda s, i: True})
        try:
            only_finish(server_args, params, components={ComponentType.FULL},
                        extra_config=config["linker_extra_config"], forward_stream=None)
            check(False, "package constructor rejects forward_stream")
        except TypeError as error:
            check("forward_stream" in str(error), f"package constructor rejects forward_stream (change 1): {error}")

        # --- part 1: the linker alone -------------------------------------------------------
        marker = object()
        producer = build(config, forward_stream=marker)
        check(type(producer).__name__ == "FsLinkerCompat" and producer.forward_stream is marker,
              "FsLinkerCompat built by the factory, forward_stream stored")
        keys = get_storage_hash_str(list(range(100, 100 + pages * page)), None, page_size=page)
        source = allocator.alloc(pages * page)
        expected = fill(pool, source, seed=0)
        transfer = [PoolTransfer(name=PoolName.KV, device_indices=source, keys=keys)]
        try:
            FileSystemLinker.offload(producer, transfer, session_id="s")
            check(False, "package offload rejects session_id")
        except TypeError as error:
            check("session_id" in str(error), f"package offload rejects session_id (change 3): {error}")
        # as UnifiedCacheLinkerWrapper._offload_node calls it
        queued = producer.offload(transfer, session_id="selfcheck-session")
        check(queued and producer.num_completed_offloads() == 1 and producer.pop_completed_offload() is True,
              f"offload of {pages} pages queued and completed True")
        files = sorted(Path(directory).rglob("*.pt"))
        check(len(files) == pages, f"{len(files)} page files written under {files[0].parent if files else directory}")
        producer.close()

        # A fresh instance (as after a restart) looks the prefix up and loads it into other slots.
        linker = build(config)
        hits = linker.lookup("r1", [PoolTransfer(name=PoolName.KV, keys=keys + ["missing-page"])])
        check(hits == list(range(1, pages + 1)), f"lookup returns restorable prefixes {hits}")
        target = allocator.alloc(pages * page)
        for buffer in (*pool.k_buffer, *pool.v_buffer):
            buffer[target] = 0
        check(linker.load("r1", [PoolTransfer(name=PoolName.KV, device_indices=target, keys=keys)]),
              f"load queued into slots {target[0].item()}..{target[-1].item()} (stored from "
              f"{source[0].item()}..{source[-1].item()})")
        check(not any(k[target].any() for k in pool.k_buffer), "no bytes written before start_layer_wise_loading")
        index = linker.start_layer_wise_loading()
        pool.register_layer_transfer_counter(linker.layer_done_counter)  # as registry.py does
        linker.layer_done_counter.set_consumer(index)  # as tp_worker does; the pool calls wait_until
        compare(0, pool, target, expected)
        check(linker.finish_layer_wise_loading(index) is True, f"finish_layer_wise_loading({index}) is True")
        check(len(linker.completed_loads) == 0, "no completed-load record left behind")
        check(linker.load("r2", [PoolTransfer(name=PoolName.KV, device_indices=target, keys=keys)])
              and linker.cancel_queued_load("r2") and linker.start_layer_wise_loading() == -1,
              "queued load cancelled, nothing left to start")
        linker.close()
        allocator.free(source)
        allocator.free(target)

        # --- part 2: through UnifiedRadixCache and UnifiedCacheLinkerWrapper -------------------
        cache = UnifiedRadixCache(params)
        cache.init_cache_linker(build(config, forward_stream=None))  # as registry.py does
        pool.register_layer_transfer_counter(cache.linker.layer_done_counter)
        tokens = array("q", range(500, 500 + pages * page))
        source = allocator.alloc(pages * page)
        expected = fill(pool, source, seed=1)
        before = len(list(Path(directory).rglob("*.pt")))
        cache.insert(InsertParams(key=RadixKey(token_ids=tokens), value=source, session_id="s1"))
        written = len(list(Path(directory).rglob("*.pt"))) - before
        check(written == pages and len(cache.linker.pending_offloads) == 1,
              f"insert wrote through {written} pages (offload with session_id)")
        cache.check_hicache_events()
        check(not cache.linker.pending_offloads, "offload committed by check_hicache_events")
        cache.reset()  # flush the device tree; the files stay
        req = SimpleNamespace(rid="r3", last_node=None, kv=None, swa_branching_seqlen=None, session=None)
        match = cache.match_prefix(MatchPrefixParams(key=RadixKey(token_ids=tokens + array("q", [7])), req=req))
        check(match.device_prefix_len == 0 and match.host_hit_length == pages * page,
              f"match_prefix after flush: device 0, external hit {match.host_hit_length} tokens")
        req.last_node = match.last_device_node
        loaded, _ = cache.init_load_back(InitLoadBackParams(
            best_match_node=match.best_match_node, host_hit_length=match.host_hit_length, req=req))
        target = cache.linker.private_load_indices[req.rid]
        check(loaded == pages * page, f"init_load_back queued {loaded} tokens into slots "
              f"{target[0].item()}..{target[-1].item()}")
        for buffer in (*pool.k_buffer, *pool.v_buffer):
            buffer[target] = 0  # whatever those slots held, only the load can restore them
        index = cache.ready_to_load_host_cache()
        cache.linker.layer_done_counter.set_consumer(index)
        compare(1, pool, target, expected)
        check(cache.finish_external_linker_loads([req]) == [], "finish_external_linker_loads: no failed request")
        cache.linker.close()
    shutil.rmtree(directory, ignore_errors=True)

    total = 2 * layers * pages * page * heads * head_dim * dtype.itemsize
    print(f"torchvision placeholder: {TORCHVISION_PLACEHOLDER}")
    if failures or compared != [total, total]:
        print(f"FAIL: {len(failures)} check(s) failed, bytes equal {compared} of {total} each")
        return 1
    print(f"PASS: {compared[0]} + {compared[1]} bytes compared ({layers} layers x K,V x {pages} pages x "
          f"{page} tokens x {heads} heads x {head_dim} x {dtype}), byte-identical after "
          "store -> lookup -> load, directly and through UnifiedRadixCache")
    return 0


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--selfcheck", action="store_true",
                        help="store, look up and load a few pages on CPU through SGLang 0.5.23's "
                             "factory and UnifiedRadixCache, byte for byte")
    if parser.parse_args().selfcheck:
        sys.exit(_selfcheck())
    print(__doc__)
