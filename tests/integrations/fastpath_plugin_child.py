"""The SGLang plugin route (hicache_mp_fastpath) in a fresh interpreter, for
test_sglang_plugin.py and test_sglang_fastpath.py's plugin-route variant.

argv: MODE OUT_JSON [TMP_DIR]. SGLang's `load_plugins()` runs once per
process, so each mode is its own interpreter; the parent sets or clears
HICACHE_MP_FASTPATH.

- off: no opt-in. load_plugins(), then what it imported and whether SGLang's
  classes are stock.
- version: opted in, with `sglang.__version__` (and `sglang.version.__version__`)
  set to 0.5.24 before load_plugins(), as another SGLang would read: the log's
  errors, and whether the classes are stock.
- on: opted in. load_plugins(), the log (SGLang's lines and the plugin's),
  which methods are the fast path's; then the differential's fast runs
  (fastpath_diff: dense mp/file, hybrid Mamba/SWA/DSA on mp/file) saved with
  torch.save beside OUT_JSON for the parent to compare with its stock runs.
- scheduler: a parent for `scheduler-entry` that outlives it: SGLang's
  scheduler sends SIGQUIT to its parent when it fails, and that parent must
  not be pytest.
- scheduler-entry: SGLang's real `run_scheduler_process(ServerArgs, PortArgs,
  ...)` as the entry of this fresh interpreter, as SGLang's spawned scheduler
  process runs it, on CPU (a 2-layer Llama config, dummy weights, HiCache
  with the `file` backend). On CPU it fails in `init_hicache`, when SGLang
  registers its host pool with CUDA (`cudaHostRegister`, which a CPU torch
  lacks and no server argument turns off), just before it would build the
  HiCacheController; it logs that, signals its parent and returns, and what
  the process holds is written then. Where the Scheduler is built (CUDA
  torch), a watcher writes it once the init info arrives, with the live
  controller's storage threads, and ends the process.

Logging is configured before load_plugins() (INFO, to TMP_DIR/plugins.log)
so SGLang's plugin lines, which it logs before it configures logging, are
kept.

Reaches inside: nothing private; SGLang's REPLACE wrapper's closure variable
`hook` (inspect.getclosurevars) to see which function a hooked method runs.
"""
import importlib
import importlib.abc
import importlib.machinery
import inspect
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import types

HERE = os.path.dirname(os.path.abspath(__file__))
# What SGLang's scheduler module imports that this CPU box lacks (SGLang is
# installed without its server dependencies); never called before the
# controller is built: setproctitle (a process title), einops and uvicorn
# (imported at module level by model and server code).
ABSENT = ("setproctitle", "einops", "uvicorn")


class _Absent(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        top = fullname.split(".")[0]
        if top in ABSENT and importlib.machinery.PathFinder.find_spec(top) is None:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = types.ModuleType(spec.name)
        m.__path__ = []
        m.__getattr__ = lambda name: (lambda *a, **k: None)
        return m

    def exec_module(self, module):
        pass


def log_to(path: str) -> None:
    logging.basicConfig(level=logging.INFO, filename=path,
                        format="%(process)d %(levelname)s %(name)s: %(message)s")


def stock_state() -> dict:
    """Whether SGLang's controller classes are as SGLang ships them."""
    from hicache_mp.bench.sglang import real
    sgl = real.import_stack()
    from hicache_mp.integrations.sglang import fastpath, fastpath_methods
    hooked = []
    for mod, cls_name, holder, _ in fastpath_methods.TARGETS:
        cls = getattr(importlib.import_module(mod), cls_name)
        for name, own in vars(holder).items():
            fn = vars(cls).get(name)
            if isinstance(own, types.FunctionType) and hasattr(fn, "__wrapped__"):
                hooked.append(f"{cls_name}.{name}")
    return {"hooked": hooked, "installed": fastpath.installed(),
            "added": [n for n in ("HandoffQueue", "StorageSwitchInterval")
                      if hasattr(sgl.cache_controller, n)]
            + (["hit_query_at_once"] if hasattr(sgl.HiCacheStorage, "hit_query_at_once")
               else [])}


def fast_methods() -> dict:
    """Each method the fast path replaces or adds: 'fast' where the class runs
    the fast path's code (through SGLang's REPLACE wrapper, or set directly)."""
    from hicache_mp.integrations.sglang import fastpath_methods
    out = {}
    for mod, cls_name, holder, _ in fastpath_methods.TARGETS:
        cls = getattr(importlib.import_module(mod), cls_name)
        for name, fn in vars(holder).items():
            if not isinstance(fn, types.FunctionType):
                continue
            got = vars(cls).get(name)
            if got is not None and hasattr(got, "__wrapped__"):
                got = inspect.getclosurevars(got).nonlocals.get("hook")
            out[f"{cls_name}.{name}"] = (
                "fast" if got is not None and got.__code__ is fn.__code__ else "stock")
    return out


def main_off(out: str, tmp: str) -> dict:
    log_to(os.path.join(tmp, "plugins.log"))
    from sglang.srt.plugins import load_plugins
    before = set(sys.modules)
    load_plugins()
    imported = sorted(set(sys.modules) - before)
    return {"imported": imported, **stock_state()}


def main_version(out: str, tmp: str) -> dict:
    log_to(os.path.join(tmp, "plugins.log"))
    import sglang
    import sglang.version
    sglang.__version__ = sglang.version.__version__ = "0.5.24"
    from sglang.srt.plugins import load_plugins
    load_plugins()
    controller_imported = "sglang.srt.managers.cache_controller" in sys.modules
    return {"controller_imported": controller_imported, **stock_state()}


def main_on(out: str, tmp: str) -> dict:
    log_to(os.path.join(tmp, "plugins.log"))
    # the torchvision placeholder (real.py says why), before the hooks' targets load
    from hicache_mp.bench.sglang import real
    real.import_stack()
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from hicache_mp.integrations.sglang import fastpath
    res = {"methods": fast_methods(), "installed": fastpath.installed(),
           "added": sorted(n for n in ("HandoffQueue", "StorageSwitchInterval")
                           if hasattr(sys.modules["sglang.srt.managers.cache_controller"], n))}
    import torch
    import fastpath_diff as D
    runs = {}
    for backend in ("mp", "file"):
        runs[("dense", backend)] = D.dense_run(backend, os.path.join(tmp, f"d-{backend}"),
                                               D.POLICIES)
    for geom in ("mamba", "swa", "dsa"):
        for backend in ("mp", "file"):
            runs[(geom, backend)] = D.hybrid_run(geom, backend,
                                                 os.path.join(tmp, f"{geom}-{backend}"),
                                                 D.HYBRID_POLICIES)
    torch.save(runs, out + ".runs.pt")
    return res


def main_scheduler(out: str, tmp: str) -> dict:
    # SGLang's scheduler signals its parent (SIGQUIT) when it fails; this is that parent
    signal.signal(signal.SIGQUIT, lambda *a: None)
    child = subprocess.run([sys.executable, __file__, "scheduler-entry", out, tmp],
                           stdout=open(os.path.join(tmp, "scheduler.out"), "w"),
                           stderr=subprocess.STDOUT, timeout=280)
    return {"entry_rc": child.returncode}


def main_scheduler_entry(out: str, tmp: str) -> None:
    sys.meta_path.append(_Absent())
    log_to(os.path.join(tmp, "plugins.log"))
    model = os.path.join(tmp, "model")
    os.makedirs(model, exist_ok=True)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                   "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256,
                   "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
                   "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}, f)
    from hicache_mp.bench.sglang import real
    real.import_stack()   # the torchvision placeholder, before SGLang's scheduler module
    import multiprocessing
    from sglang.srt.managers import load_snapshot
    from sglang.srt.managers.scheduler import run_scheduler_process
    from sglang.srt.server_args import PortArgs, ServerArgs
    args = ServerArgs(model_path=model, skip_tokenizer_init=True, device="cpu",
                      load_format="dummy", max_total_tokens=1024, disable_cuda_graph=True,
                      enable_hierarchical_cache=True, hicache_size=1,
                      hicache_storage_backend="file")
    ports = PortArgs.init_new(args)
    reader, writer = multiprocessing.Pipe(duplex=False)
    shm = load_snapshot.shm_path_for(ports.instance_id)

    def report(result: dict, rc: int) -> None:
        import psutil
        result["children"] = [p.pid for p in psutil.Process().children(recursive=True)]
        with open(out, "w") as f:
            json.dump(result, f)
        if os.path.exists(shm):
            os.unlink(shm)
        os._exit(rc)   # the scheduler's event loop never returns; nothing else to keep

    def watch():
        if not reader.poll(240):
            report({"built": False, "why": "no init info in 240 s"}, 3)
        info = reader.recv()
        from hicache_mp.integrations.sglang import fastpath
        report({"built": True, "pid": os.getpid(), "init_info": sorted(info)
                if isinstance(info, dict) else repr(info)[:200],
                "installed": fastpath.installed(), "methods": fast_methods(),
                "storage_threads": sorted(fastpath.running_under_fast_path())}, 0)
    threading.Thread(target=watch, daemon=True).start()
    run_scheduler_process(args, ports, 0, 0, 0, None, writer)
    # it returns only when the Scheduler failed (logged, parent signalled): what
    # this process holds at that point
    from hicache_mp.integrations.sglang import fastpath
    report({"built": False, "pid": os.getpid(), "installed": fastpath.installed(),
            "methods": fast_methods()}, 0)


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    tmp = sys.argv[3] if len(sys.argv) > 3 else os.path.dirname(out)
    if mode == "scheduler-entry":
        main_scheduler_entry(out, tmp)
    result = {"off": main_off, "version": main_version, "on": main_on,
              "scheduler": main_scheduler}[mode](out, tmp)
    if mode != "scheduler":
        with open(out, "w") as f:
            json.dump(result, f)
    else:
        with open(out + ".parent", "w") as f:
            json.dump(result, f)
