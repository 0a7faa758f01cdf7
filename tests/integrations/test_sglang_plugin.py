"""SGLang's general plugin `hicache_mp_fastpath` (hicache_mp_sglang_plugin,
registered by pip in the entry-point group `sglang.srt.plugins`) through
SGLang 0.5.23's real plugin loader.

- Without HICACHE_MP_FASTPATH: SGLang's `load_plugins()`, in a fresh
  interpreter, loads and runs the plugin, which imports nothing of
  hicache_mp and no SGLang module SGLang had not, registers no hook, and
  leaves SGLang's classes stock.
- Another SGLang version: in a fresh interpreter `sglang.__version__` (and
  `sglang.version.__version__`) read 0.5.24 before `load_plugins()`, as they
  would in SGLang 0.5.24. One error, naming both versions; no hook applied;
  stock.
- An 0.5.23 whose replaced methods differ from stock, and an opt-in value
  that is neither 1 nor 0: the plugin's function, here (it registers nothing
  when it refuses, so no loader is needed): one error, stock.
- SGLang's scheduler process: `run_scheduler_process` with real ServerArgs
  as the entry of a fresh interpreter, opted in: its own `load_plugins()`
  applies the plugin's hooks in that process (SGLang's log lines, with its
  pid), and the process still holds them where SGLang stops on CPU (its host
  pool's cudaHostRegister in init_hicache, before the cache controller).
- `hicache-mp sglang-serve`: the alias's help, its check that SGLang would
  load the plugin, and its exec of `python -m sglang.launch_server`.

With the opt-in, and the differential through the plugin route:
test_sglang_fastpath.py (one interpreter serves both).

Reaches inside: SGLang's `HybridCacheController._page_transfer_sidecar`, a
private method the fast path replaces: swapped for a stand-in to show the
plugin refuses an 0.5.23 whose methods are not stock.
"""
import json
import logging
import os
import pathlib
import sys

import plugin_children
import pytest

PLUGIN_LINE = "(from: plugin=hicache_mp_fastpath, dist=hicache_mp)"


@pytest.fixture(scope="module")
def children():
    """The four fresh interpreters (plugin_children.py), started when the
    session started where it could, else now: (them, /dev/shm's SGLang
    entries before any ran)."""
    started = plugin_children.take()
    yield started
    started.close()


def test_without_the_opt_in_the_plugin_does_nothing(children):
    r = children.children["off"].report()
    # SGLang found, loaded and ran it ...
    assert "Loaded plugin hicache_mp_fastpath from group sglang.srt.plugins" in r["log"]
    assert "Executed general plugin: hicache_mp_fastpath" in r["log"]
    # ... which imported only itself: no hicache_mp, no SGLang controller module
    assert r["imported"] == ["hicache_mp_sglang_plugin"], r["imported"]
    assert "Applied" not in r["log"] and "hicache_mp:" not in r["log"]
    assert r["hooked"] == [] and r["added"] == [] and not r["installed"]


def test_another_sglang_version_is_one_error_and_stock(children):
    r = children.children["version"].report()
    errors = [line for line in r["log"].splitlines() if " ERROR " in line]
    assert len(errors) == 1, errors
    assert "SGLang 0.5.23 only; this is SGLang 0.5.24" in errors[0]
    assert "keeps its stock storage path" in errors[0]
    assert "Executed general plugin: hicache_mp_fastpath" in r["log"]   # ran, did not raise
    assert "Applied" not in r["log"]
    # refused before anything was imported for it, and nothing changed
    assert not r["controller_imported"]
    assert r["hooked"] == [] and r["added"] == [] and not r["installed"]


@pytest.fixture
def sglang_stack():
    from hicache_mp.bench.sglang import real
    try:
        return real.import_stack()
    except ImportError as exc:
        pytest.skip(f"SGLang's host-pool/controller chain is not importable ({exc})")


@pytest.mark.parametrize("case", ["methods differ", "bad value"])
def test_the_plugin_refuses_with_one_error(sglang_stack, monkeypatch, caplog, case):
    import hicache_mp_sglang_plugin
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import \
        HybridCacheController
    from hicache_mp.integrations.sglang import fastpath
    stock = HybridCacheController._page_transfer_sidecar
    monkeypatch.setenv("HICACHE_MP_FASTPATH", "1" if case == "methods differ" else "yes")
    if case == "methods differ":
        monkeypatch.setattr(HybridCacheController, "_page_transfer_sidecar",
                            lambda self, op, pages: None)
    with caplog.at_level(logging.INFO):
        hicache_mp_sglang_plugin.load()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].name == "hicache_mp.sglang_plugin"
    want = ("_page_transfer_sidecar is not the one the fast path was built from"
            if case == "methods differ" else "HICACHE_MP_FASTPATH='yes' is neither 1")
    assert want in errors[0].getMessage() and "stock" in errors[0].getMessage()
    assert not fastpath.installed()
    assert not hasattr(sglang_stack.cache_controller, "HandoffQueue")
    monkeypatch.undo()
    assert HybridCacheController._page_transfer_sidecar is stock


def test_sglangs_scheduler_process_loads_the_plugin(children):
    """SGLang's real run_scheduler_process (ServerArgs of a 2-layer Llama
    config with dummy weights, HiCache on the `file` backend, CPU) as the entry
    of a fresh interpreter: its load_plugins() ran the plugin there and the
    hooks were applied in that process. On CPU it then gets through the model
    load, the device KV cache and the radix tree, and stops in init_hicache
    where SGLang registers its host pool with CUDA, before it builds the
    cache controller; the process still runs the fast path's methods there.
    With a CUDA torch it goes on: the Scheduler is built, and the live
    controller's storage threads are the fast path's."""
    shm_before = children.shm_before
    r = children.children["scheduler"].report()
    tmp_path = pathlib.Path(children.children["scheduler"].tmp_path)
    with open(str(tmp_path / "scheduler.json.parent")) as f:
        assert json.load(f)["entry_rc"] == 0
    sched_out = (tmp_path / "scheduler.out").read_text()
    pid = r["pid"]
    mine = [line for line in r["log"].splitlines() if line.startswith(f"{pid} ")]
    assert any(line.endswith("Executed general plugin: hicache_mp_fastpath") for line in mine)
    assert any("Applied 1 hook(s) to sglang.srt.managers.cache_controller.HiCacheController."
               f"prefetch {PLUGIN_LINE}" in line for line in mine), r["log"][-2000:]
    assert r["installed"] and set(r["methods"].values()) == {"fast"}
    if r["built"]:
        assert "HiCacheController built with the SGLang storage fast path" in sched_out
        assert "HiCacheController.prefetch_thread" in r["storage_threads"]
    else:   # how far it gets on CPU, exactly
        assert "Scheduler hit an exception" in sched_out
        assert "init_hicache" in sched_out and "_cuda_host_register" in sched_out
        assert "Torch not compiled with CUDA enabled" in sched_out
        assert "Load weight end" in sched_out and "KV Cache is allocated" in sched_out
    # nothing left: no process under it when it ended, no segment of SGLang's
    assert r["children"] == []
    assert {n for n in os.listdir("/dev/shm") if n.startswith("sglang")} <= shm_before


def test_sglang_serve_is_an_alias_of_sglangs_launcher(children, capsys, monkeypatch):
    from hicache_mp import cli
    from hicache_mp.integrations.sglang import serve
    with pytest.raises(SystemExit) as e:
        cli.main(["sglang-serve", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "HICACHE_MP_FASTPATH=1 python -m sglang.launch_server" in out
    assert serve.command(["--model-path", "m"]) == [sys.executable, "-m",
                                                    "sglang.launch_server", "--model-path", "m"]
    # what would make the opt-in silently do nothing is refused before anything starts
    assert serve.plugin_problem({}) is None   # registered (pip install -e)
    assert "leaves out hicache_mp_fastpath" in serve.plugin_problem(
        {"SGLANG_PLUGINS": "someone_else"})
    assert serve.plugin_problem({"SGLANG_PLUGINS": "x, hicache_mp_fastpath"}) is None
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else")
    assert cli.main(["sglang-serve", "--", "--help"]) == 2   # returned: nothing was exec'd
    assert "SGLANG_PLUGINS='someone_else' leaves out" in capsys.readouterr().err
    monkeypatch.undo()
    # the arguments after -- reach SGLang's own launcher, which replaced the process
    rc, out, err = children.alias.result()
    assert rc == 0, err[-2000:]
    assert "HICACHE_MP_FASTPATH=1 -m sglang.launch_server --help" in err
    assert "--model-path" in out and "--enable-hierarchical-cache" in out
