"""The SGLang storage fast path (hicache_mp.integrations.sglang.fastpath) against
SGLang 0.5.23's stock controller, through SGLang's real classes on CPU.

- Differential: the same workload through a stock controller and through one
  built after `install()` gives the same acks, the same pages in the same host
  slots and the same backup files; and the same through the plugin route: the
  fast runs in a fresh interpreter where SGLang's own `load_plugins()` ran the
  `hicache_mp_fastpath` plugin with HICACHE_MP_FASTPATH=1 (fastpath_plugin_child.py),
  where every replaced method is seen to run the fast path's code and SGLang's
  log names the plugin for each hook. The workload (fastpath_diff.py): dense
  (`HiCacheController`) on `mp` and SGLang's `file`, under each prefetch
  policy as the scheduler plays it
  against the controller (wait_complete: never terminated; best_effort:
  terminated when scheduled, here before its transfer starts; timeout:
  terminated at its deadline, here while the second batch is in flight).
  Hybrid (`HybridCacheController`, v2) over Mamba, SWA and DSA on `mp` and
  `file`, never terminated and terminated while its KV batch is in flight.
- SGLang's failure injector over the fast path: no wrong page, no hang.
- The hand-offs: at most one SGLang-side wait per batch on its storage threads.
- install() applied, idempotent, undone, and refused (another version, or an
  0.5.23 whose methods differ); the upstream patch is what install() does and
  applies to a copy of SGLang's installed sources. The plugin without the
  opt-in, with another version, in SGLang's scheduler process, and the
  `sglang-serve` alias: test_sglang_plugin.py.

Reaches inside: SGLang's `HiCacheController._reduce_prefetch_ack` and
`HybridCacheController._page_transfer_sidecar`, private methods of SGLang's
controllers that install() replaces: the test reads them to see them replaced
and restored, and swaps one for a stand-in to show install() refuses an
0.5.23 whose methods are not the ones the fast path was built from.
"""
import inspect
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time

import early  # noqa: E402  (tests/early.py)
import plugin_children
import pytest

from hicache_mp.bench.sglang import real as sglang_real

try:
    SGL = sglang_real.import_stack()
except ImportError as exc:
    pytest.skip(f"SGLang's host-pool/controller chain is not importable ({exc})",
                allow_module_level=True)

import torch  # noqa: E402

from hicache_mp.bench.sglang import stack as sglang_stack  # noqa: E402
from hicache_mp.bench.sglang.stack import Scheduler  # noqa: E402
from hicache_mp.integrations.sglang import fastpath, fastpath_methods  # noqa: E402
from fastpath_diff import (DENSE, HYBRID_POLICIES, POLICIES, SGL_THREADS,  # noqa: E402
                           dense_round, dense_run, hybrid_run)

UPSTREAM = os.path.join(os.path.dirname(fastpath.__file__), "upstream")
PATCH = os.path.join(UPSTREAM, "sglang-0.5.23-hicache-fastpath.patch")
SITE = sysconfig.get_paths()["purelib"]
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def _stock_after():
    yield
    fastpath.uninstall()


def test_hit_query_runs_in_prefetch_only_when_it_cannot_wait(tmp_path):
    """With the fast path, mp's hit query of pages this engine wrote is
    answered inside prefetch() (its hit is queued when the call returns); a
    second engine on the same store, started before they were written, must ask
    the store (workers' probes): its query goes to SGLang's prefetch thread,
    as stock, and still finds the whole prefix, bytes intact."""
    fastpath.install()
    args = sglang_stack.parse(DENSE)
    store = str(tmp_path / "store")
    a = sglang_stack.Stack(SGL, "mp", args, store)
    b = None
    try:
        # b starts on the empty store: what a writes next, only a's index knows
        # (b's pool is filled from the same seed: its src pages are a's bytes)
        b = sglang_stack.Stack(SGL, "mp", args, store)
        _, written = sglang_stack.backup(a.ctl, a.src, a.tokens, a.hashes, Scheduler(False), 30)
        assert written == len(a.tokens)
        op = a.ctl.prefetch("inline", a.tokens, None)
        assert a.ctl.prefetch_hit_queue.qsize() == 1            # answered in the call
        assert a.ctl.prefetch_hit_queue.get_nowait() is op
        assert op.storage_hit_count == len(a.tokens)
        assert a.ctl.prefetch_queue.unfinished_tasks == 0       # nothing was queued
        be = sglang_stack.backend_of(b.ctl)
        assert not be.hit_query_at_once(b.hashes)               # unknown to b: would wait
        t, done, idx = sglang_stack.prefetch(b.ctl, b.hp, [(b.tokens, None)], Scheduler(False), 30)
        assert done == [len(b.tokens)]
        b.check(idx[0], done[0])
        assert b.wrong_pages == 0 and b.checked_pages == b.pages
        b.hp.free(idx[0])
        assert be.hit_query_at_once(b.hashes)                   # indexed now: at once next time
    finally:
        a.close()
        if b is not None:
            b.close()


# --- the differential, through install() and through SGLang's plugin loader ---------------
# The stock runs, once per workload: both routes' fast runs are compared with them.
_STOCK: dict = {}


def stock_run(key, run):
    if key not in _STOCK:
        assert not fastpath.installed()
        _STOCK[key] = run()
    return _STOCK[key]


@pytest.fixture(scope="module")
def plugin_route():
    """One fresh interpreter where SGLang's own load_plugins() ran the
    hicache_mp_fastpath plugin with HICACHE_MP_FASTPATH=1 (nothing else
    installs the fast path there), then every fast run of the differential
    (fastpath_plugin_child.py, mode on; started with the session where it
    could: plugin_children.py): its report, SGLang's plugin log and the runs."""
    child, base = plugin_children.take_route()
    try:
        report = child.report()
        report["runs"] = torch.load(child.out + ".runs.pt", weights_only=False)
    finally:
        child.err.close()
        shutil.rmtree(base, ignore_errors=True)
    return report


def fast_run(request, route, key, run):
    """The fast path's side of a comparison: install() here, or the plugin route's child."""
    if route == "plugin":
        return request.getfixturevalue("plugin_route")["runs"][key]
    changed = fastpath.install()
    assert "added sglang.srt.managers.cache_controller.HiCacheController._publish_prefetch_ack" \
        in changed
    return run()


@pytest.mark.parametrize("route", ["install", "plugin"])
@pytest.mark.parametrize("backend", ["mp", "file"])
def test_dense_same_as_stock(tmp_path, backend, route, request):
    stock = stock_run(("dense", backend),
                      lambda: dense_run(backend, str(tmp_path / "stock"), POLICIES))
    fast = fast_run(request, route, ("dense", backend),
                    lambda: dense_run(backend, str(tmp_path / "fast"), POLICIES))
    src = stock[2]
    assert all(torch.equal(a, b) for a, b in zip(src, fast[2]))   # the same truth
    for p in POLICIES:
        (a_acks, a_slots, a_pages), (b_acks, b_slots, b_pages) = stock[0][p], fast[0][p]
        assert a_acks == b_acks, p
        assert a_slots == b_slots, p
        assert len(a_pages) == len(b_pages)
        assert all(torch.equal(x, y) and torch.equal(x, src[i])
                   for i, (x, y) in enumerate(zip(a_pages, b_pages))), p
    full = len(stock[0]["wait_complete"][1])   # every token (a host slot each) landed
    assert stock[0]["wait_complete"][0] == [(512, False), (full, False), (None, True)]
    assert stock[0]["best_effort"][0] == [(0, False), (0, False), (None, True)]
    # terminated during batch 2: SGLang's generic get (file) stops at that batch's first
    # page, the zero-copy get (mp) finishes the batch it is in
    assert stock[0]["timeout"][0][1] == ((512 if backend == "file" else full), False)
    assert stock[1] == fast[1] and len(stock[1]) >= len(src)       # the same backup files
    # the fast path's ack hop is gone: its sync thread has exited, the others run
    assert "prefetch_sync_thread_func" in stock[3] and len(stock[3]) == 4
    assert fast[3] == sorted(set(stock[3]) - {"prefetch_sync_thread_func"})


@pytest.mark.parametrize("route", ["install", "plugin"])
@pytest.mark.parametrize("backend", ["mp", "file"])
@pytest.mark.parametrize("geom", ["mamba", "swa", "dsa"])
def test_hybrid_same_as_stock(tmp_path, geom, backend, route, request):
    stock = stock_run((geom, backend), lambda: hybrid_run(
        geom, backend, str(tmp_path / "stock"), HYBRID_POLICIES))
    fast = fast_run(request, route, (geom, backend), lambda: hybrid_run(
        geom, backend, str(tmp_path / "fast"), HYBRID_POLICIES))
    for p in HYBRID_POLICIES:
        assert stock[p] == fast[p], p
    assert stock["wrong"] == fast["wrong"] == 0 and stock["checked"] == fast["checked"] > 0
    assert stock["files"] == fast["files"] and stock["files"]
    acks = stock["wait_complete"][0]
    assert acks[-1] == (None, None, True) and acks[0][0] > 0   # all 4 KV pages
    side = {"mamba": "mamba", "swa": "swa", "dsa": None}[geom]
    if side:   # the sidecar's ack: every pool named, its own hit counted
        assert acks[1][1][side] > 0
    # terminated while the KV batch was in flight: the batch lands, the sidecar is skipped
    assert all(v == 0 for v in stock["best_effort"][0][-2][1].values())


# --- SGLang's failure injector over the fast path ----------------------------------------
def test_failure_injector_over_the_fast_path(tmp_path):
    """Random failures and delays on every backend call (SGLang's
    HiCacheStorageFailureInjector): every round ends, a short read is a leading
    prefix, and every page it reports landed is exact."""
    fastpath.install()
    args = sglang_stack.parse(["--round-mib", "0.25", "--page-mib", "0.0078125", "--layers",
                               "2", "--heads", "4", "--head-dim", "64", "--workers", "1",
                               "--timeout-s", "30", "--inject-rounds", "6",
                               "--inject-failure", "0.4", "--inject-delay", "0.002"])
    out = sglang_stack.injector_run(SGL, args, str(tmp_path))
    assert out["wrapped"] == "HiCacheStorageFailureInjector"
    assert len(out["read_tokens"]) == 6 and out["wrong_pages"] == 0
    assert out["checked_pages"] == sum(out["read_tokens"]) // args.page_size


# --- install(): applied, idempotent, undone, refused -------------------------------------
def test_install_applies_and_refuses():
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import \
        HybridCacheController
    stock = HiCacheController._reduce_prefetch_ack
    with pytest.raises(fastpath.FastPathVersionError, match="0.5.23 only; this is SGLang 0.5.24"):
        fastpath.install(version="0.5.24")
    assert HiCacheController._reduce_prefetch_ack is stock and not fastpath.installed()
    # an 0.5.23 whose methods are not the ones it was built from: refused, nothing changed
    HybridCacheController._page_transfer_sidecar, own = (
        lambda self, op, pages: None), HybridCacheController._page_transfer_sidecar
    try:
        with pytest.raises(fastpath.FastPathVersionError, match="_page_transfer_sidecar is not"):
            fastpath.install()
    finally:
        HybridCacheController._page_transfer_sidecar = own
    assert HiCacheController._reduce_prefetch_ack is stock and not fastpath.installed()
    changed = fastpath.install()
    assert sorted(changed) == sorted(
        ["added sglang.srt.managers.cache_controller.HandoffQueue",
         "added sglang.srt.managers.cache_controller.StorageSwitchInterval",
         "added sglang.srt.mem_cache.hicache_storage.HiCacheStorage.hit_query_at_once"] +
        [f"replaced sglang.srt.managers.cache_controller.HiCacheController.{m}" for m in
         ("_start_storage_threads", "prefetch", "_storage_hit_query", "prefetch_thread_func",
          "_page_transfer", "prefetch_io_aux_func", "prefetch_sync_thread_func",
          "_sync_prefetch_hit_query", "_reduce_prefetch_ack")] +
        [f"added sglang.srt.managers.cache_controller.HiCacheController.{m}" for m in
         ("_submit_hit_query", "_answer_hit_query", "_publish_prefetch_ack",
          "_min_across_ranks")] +
        [f"replaced sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller."
         f"HybridCacheController.{m}" for m in
         ("prefetch", "_storage_hit_query",
          "_page_transfer_sidecar", "_sync_prefetch_hit_query", "_reduce_prefetch_ack",
          "prefetch_sync_thread_func")] +
        ["added sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller."
         "HybridCacheController._publish_prefetch_ack"])
    assert fastpath.install() == []   # idempotent
    fn = HybridCacheController._reduce_prefetch_ack
    # runs as if written in SGLang's module: its names, and super() of the hybrid class
    assert fn.__globals__ is HybridCacheController.__init__.__globals__
    assert fn.__closure__[0].cell_contents is HybridCacheController
    assert len(fastpath.uninstall()) == len(changed)
    assert HiCacheController._reduce_prefetch_ack is stock
    assert not hasattr(HiCacheController, "_publish_prefetch_ack")
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
    from sglang.srt.managers import cache_controller
    assert not hasattr(HiCacheStorage, "hit_query_at_once")
    assert not hasattr(cache_controller, "HandoffQueue")
    assert not hasattr(cache_controller, "StorageSwitchInterval")


def test_uninstall_refuses_while_a_controller_runs_fast_path_threads(tmp_path):
    """uninstall() under a live controller built with the fast path would leave
    its storage threads running the fast path's loops over stock methods
    (NameError on StorageSwitchInterval, prefetches that never end): it
    refuses, changes nothing, and the controller still prefetches; once the
    controller's threads are stopped it goes through. A controller built
    before install() runs stock loops and does not hold it back."""
    from sglang.srt.managers import cache_controller
    args = sglang_stack.parse(DENSE)
    before = sglang_stack.Stack(SGL, "mp", args, str(tmp_path / "before"))
    fast = None
    try:
        fastpath.install()
        fast = sglang_stack.Stack(SGL, "mp", args, str(tmp_path / "fast"))
        with pytest.raises(fastpath.FastPathInUse, match="detach_storage_backend") as caught:
            fastpath.uninstall()
        assert "HiCacheController.prefetch_thread" in str(caught.value)
        assert isinstance(caught.value, fastpath.FastPathError)
        assert fastpath.installed() and hasattr(cache_controller, "StorageSwitchInterval")
        _, written = sglang_stack.backup(fast.ctl, fast.src, fast.tokens, fast.hashes,
                                         Scheduler(False), 30)
        assert written == len(fast.tokens)
        _, _, pages = dense_round(fast, "wait_complete")
        assert len(pages) == fast.pages
        assert all(torch.equal(p, fast.page(fast.src, i)) for i, p in enumerate(pages))
        fast.close()
        assert fastpath.running_under_fast_path() == []
        assert fastpath.uninstall() and not fastpath.installed()
        assert not hasattr(cache_controller, "StorageSwitchInterval")
    finally:
        if fast is not None:
            fast.close()
        before.close()


# --- the upstream patch -------------------------------------------------------------------
def test_patch_is_install_and_applies(tmp_path):
    """The shipped patch is what install() does (generated from the same
    methods) and applies cleanly to a copy of SGLang 0.5.23's installed sources;
    the patched files compile and hold install()'s methods."""
    from hicache_mp.integrations.sglang import fastpath_methods
    with open(PATCH) as f:
        assert f.read() == fastpath.patch_text(SITE), \
            "stale patch: run python3 scripts/sglang_fastpath_patch.py"
    mods = fastpath.patched_modules()
    rels = [m.replace(".", "/") + ".py" for m in mods]
    for rel in rels:
        os.makedirs(tmp_path / os.path.dirname(rel), exist_ok=True)
        shutil.copy(os.path.join(SITE, rel), tmp_path / rel)
    tool = shutil.which("patch")
    cmd = ([tool, "-p1", "--dry-run", "-i", PATCH] if tool else
           ["git", "apply", "--check", "-p1", PATCH])
    subprocess.run(cmd, cwd=tmp_path, check=True, capture_output=True)
    subprocess.run([tool, "-p1", "-s", "-i", PATCH] if tool else ["git", "apply", "-p1", PATCH],
                   cwd=tmp_path, check=True, capture_output=True)
    for mod, rel in zip(mods, rels):
        text = (tmp_path / rel).read_text()
        compile(text, rel, "exec")
        with open(os.path.join(SITE, rel)) as f:
            assert text == fastpath.patched_module(f.read(), mod)
        for m, cls, _ in fastpath_methods.CLASSES:
            assert m != mod or f"\nclass {cls.__name__}(" in text \
                or f"\nclass {cls.__name__}:" in text
        assert "hicache_mp" not in text   # every backend gains; nothing of ours in it


# --- the hand-offs, counted on SGLang's threads ----------------------------------------------
def test_handoffs_per_batch(tmp_path):
    """One dense prefetch of two batches on mp: SGLang's own waits (outside
    the backend's calls) are the I/O thread's wake once the slots are
    allocated, one per request (its hit query ran on the scheduler thread);
    stock adds the prefetch thread's wake, the sync thread's wake per ack and a
    Tensor.item per ack and per hit query."""
    from hicache_mp.bench.sglang.handoffs import HandoffTracer, dense_prefetch
    tr = HandoffTracer().install()
    try:
        stock = dense_prefetch(tr, "stock", "mp", str(tmp_path / "s"), rounds=2)
        fastpath.install()
        fast = dense_prefetch(tr, "fast", "mp", str(tmp_path / "f"), rounds=2)
    finally:
        tr.uninstall()
    assert stock["wrong_pages"] == fast["wrong_pages"] == 0 and fast["batches"] == 2
    own = {lb: [r for r in tr.table(lb) if r["backend_call"] == "-" and r["thread"] in SGL_THREADS]
           for lb in ("stock", "fast")}
    waits = {lb: tr.sglang_waits(lb) for lb in ("stock", "fast")}
    assert waits["fast"] <= 1, own["fast"]   # one per request (of 2 batches)
    # the hit query ran in prefetch(), on the scheduler thread (mp answers its
    # own pages at once): the I/O thread's wake for the slots is all that is left
    assert {r["thread"] for r in own["fast"]} == {"prefetch_io_aux_func"}, own["fast"]
    assert not any(r["kind"] == "Tensor.item" for r in own["fast"])
    assert any(r["thread"] == "prefetch_sync_thread_func" for r in own["stock"])
    assert waits["stock"] > waits["fast"]


# --- the plugin route: SGLang's loader installs it (its differential runs above) -----------
def test_plugin_route_installs_the_fast_path_through_sglangs_hooks(plugin_route):
    """In the plugin route's fresh interpreter, after SGLang's load_plugins()
    with HICACHE_MP_FASTPATH=1: every method the fast path replaces or adds
    runs the fast path's code (SGLang's REPLACE wrappers call it), its classes
    are in cache_controller, and SGLang's log names the plugin and its
    distribution for every hooked method, beside the plugin's own line."""
    r, log = plugin_route, plugin_route["log"]
    want = {f"{cls}.{name}" for _, cls, holder, _ in fastpath_methods.TARGETS
            for name, fn in vars(holder).items() if inspect.isfunction(fn)}
    assert set(r["methods"]) == want and len(want) >= 20
    assert {k for k, v in r["methods"].items() if v != "fast"} == set()
    assert r["installed"] and r["added"] == ["HandoffQueue", "StorageSwitchInterval"]
    assert "Loaded plugin hicache_mp_fastpath from group sglang.srt.plugins" in log
    assert "Executed general plugin: hicache_mp_fastpath" in log
    assert "hicache_mp: SGLang storage fast path registered with SGLang's HookRegistry" in log
    for mod, cls, _, stock_name in [(m, c, None, n) for m, c, h, _ in fastpath_methods.TARGETS
                                    for n in vars(h) if f"{c}.{n}" in fastpath.STOCK_SOURCES]:
        assert (f"Applied 1 hook(s) to {mod}.{cls}.{stock_name} "
                f"(from: plugin=hicache_mp_fastpath, dist=hicache_mp)") in log, stock_name
    assert " ERROR " not in log and "Failed to apply hooks" not in log
    # the line a server's scheduler shows (its AFTER hook on HiCacheController.__init__),
    # once per controller the differential built: dense, and hybrid through super()
    for cls in ("HiCacheController", "HybridCacheController"):
        assert (f"hicache_mp: {cls} built with the SGLang storage fast path "
                f"(HICACHE_MP_FASTPATH=1)") in log, cls


# --- HandoffQueue: the scheduler's put() hands the GIL to the woken storage thread ----------
def test_handoff_queue_put_returns_once_a_waiting_consumer_has_the_item():
    """put() to a consumer blocked in get() returns only once that consumer has
    taken the item (with the GIL released meanwhile, the consumer runs at
    once); to a busy consumer it returns at once and the item waits its turn.
    The wait bound is raised so the check does not hang on the box's speed."""
    from hicache_mp.integrations.sglang.fastpath_methods import HandoffQueue
    q = HandoffQueue()
    q.handoff_wait_s = 30.0
    got, release = [], threading.Event()

    def consumer():
        while True:
            item = q.get()
            got.append(item)
            if item is None:
                return
            release.wait(30)        # busy with the item (a backend call)

    t = threading.Thread(target=consumer, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while q.consumers_waiting == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert q.consumers_waiting == 1
    q.put("first")
    assert got == ["first"] and q.qsize() == 0           # taken before put() returned
    t0 = time.monotonic()
    q.put("second")                                       # the consumer is busy: no wait
    assert time.monotonic() - t0 < 10 and q.qsize() == 1 and got == ["first"]
    release.set()
    q.put(None)
    t.join(10)
    assert not t.is_alive() and got == ["first", "second", None]
    t0 = time.monotonic()
    q.put("after")                                        # nobody waits in get(): no wait
    assert time.monotonic() - t0 < 10 and q.get_nowait() == "after"
    assert q.consumers_waiting == 0 and q.taken_count == 3


# --- StorageSwitchInterval: a storage thread's return to the GIL costs 0.5 ms, not 5 ---------
@pytest.fixture
def _switch_interval():
    import sys
    old = sys.getswitchinterval()
    yield old
    sys.setswitchinterval(old)


def test_storage_switch_interval_nests_restores_and_keeps_the_users(_switch_interval):
    """The span lowers the process's interval once, however many threads are
    inside; the last one out restores it. A lower interval the user set is
    kept, and one the user changed while a span was open is left as set."""
    import sys
    from hicache_mp.integrations.sglang.fastpath_methods import StorageSwitchInterval as Span
    def now_us():   # CPython keeps the interval in whole microseconds
        return round(sys.getswitchinterval() * 1e6)
    sys.setswitchinterval(0.005)
    a, b = Span(), Span()
    with a:
        assert now_us() == 500
        with b:
            assert now_us() == 500
        assert now_us() == 500                    # a is still inside
    assert now_us() == 5000 and Span.inside == 0
    sys.setswitchinterval(0.0002)                 # the user's, lower
    users = now_us()
    with Span():
        assert now_us() == users < 500
    assert now_us() == users
    sys.setswitchinterval(0.005)
    with Span():
        sys.setswitchinterval(0.003)              # the user's, meanwhile
    assert now_us() == 3000
    sys.setswitchinterval(0.005)
    with pytest.raises(RuntimeError):
        with Span():
            raise RuntimeError("a backend's error")
    assert now_us() == 5000 and Span.inside == 0


@pytest.mark.parametrize("variant", ["stock", "fast"])
def test_a_prefetch_runs_under_the_short_interval_only_with_the_fast_path(
        tmp_path, variant, _switch_interval):
    """Through SGLang's real controller: with the fast path, the backend's
    hit query on the prefetch thread (SGLang's `file`, which does not answer
    at once) and its reads on the I/O thread run while the process's switch
    interval is 0.5 ms, and the interval is the process's own again once the
    prefetch is done; stock, it is never changed. Bytes checked."""
    import sys
    from hicache_mp.integrations.sglang.fastpath_methods import StorageSwitchInterval
    if variant == "fast":
        fastpath.install()
    sys.setswitchinterval(0.005)
    args = sglang_stack.parse(DENSE)
    s = sglang_stack.Stack(SGL, "file", args, str(tmp_path / "store"))
    try:
        _, written = sglang_stack.backup(s.ctl, s.src, s.tokens, s.hashes, Scheduler(False), 30)
        assert written == len(s.tokens)
        seen = {}
        be = s.ctl.storage_backend
        for name in ("batch_exists", "batch_get"):
            fn = getattr(be, name)

            def spy(*a, _fn=fn, _name=name, **k):
                seen.setdefault(_name, set()).add(sys.getswitchinterval())
                return _fn(*a, **k)
            setattr(be, name, spy)
        _, done, idx = sglang_stack.prefetch(s.ctl, s.hp, [(s.tokens, None)], Scheduler(False), 30)
        assert done == [len(s.tokens)]
        s.check(idx[0], done[0])
        assert s.wrong_pages == 0 and s.checked_pages == s.pages
        s.hp.free(idx[0])
        want = {500 if variant == "fast" else 5000}   # microseconds
        assert {k: {round(x * 1e6) for x in v} for k, v in seen.items()} == \
            {"batch_exists": want, "batch_get": want}, seen
        deadline = time.monotonic() + 10   # the I/O thread leaves its span after its last ack
        while round(sys.getswitchinterval() * 1e6) != 5000 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert round(sys.getswitchinterval() * 1e6) == 5000
        assert StorageSwitchInterval.inside == 0
    finally:
        s.close()


def test_a_query_answered_at_once_never_sleeps_on_that_thread(tmp_path):
    """hit_query_at_once said True, then the store's answer it relied on went
    stale before the query (PROBE_TTL_S): the query on that thread still does
    not sleep in the engine (it is answered from hit_query_at_once's own
    pass), while the same query on another thread waits for the answer."""
    from hicache_mp.engine.discovery import PROBE_TTL_S
    args = sglang_stack.parse(DENSE)
    s = sglang_stack.Stack(SGL, "mp", args, str(tmp_path / "store"))
    try:
        be = sglang_stack.backend_of(s.ctl)
        keys = [f"absent-{i}" for i in range(4)]

        def sleeps():
            m = be.engine.metrics()
            return m["wait_wakeups_posted"] + m["wait_wakeups_timeout"]
        assert be.batch_exists(keys) == 0               # asks the store, waits for "missing"
        assert be.hit_query_at_once(keys)               # that answer is fresh
        time.sleep(PROBE_TTL_S + 0.05)                  # ... and now stale
        before = sleeps()
        assert be.batch_exists(keys) == 0
        assert sleeps() == before                       # not waited for
        time.sleep(PROBE_TTL_S + 0.05)
        out = []
        t = threading.Thread(target=lambda: out.append(be.batch_exists(keys)))
        t.start()
        t.join(30)
        assert out == [0] and sleeps() > before         # another thread: it waits
    finally:
        s.close()


@pytest.mark.parametrize("backend", ["mp", "file"])
def test_only_a_backend_that_can_answer_at_once_is_hashed_on_the_scheduler(
        tmp_path, monkeypatch, backend):
    """SGLang's `file` keeps HiCacheStorage's default hit_query_at_once: its
    pages are hashed and queried on the prefetch thread, as stock (a long
    prompt's hashing stays off the scheduler thread); mp's on the caller's."""
    from sglang.srt.managers import cache_controller
    fastpath.install()
    real, threads = cache_controller.get_storage_hash_str, []

    def spy(*a, **k):   # the real hash, and which thread asked for it
        threads.append(threading.get_ident())
        return real(*a, **k)
    monkeypatch.setattr(cache_controller, "get_storage_hash_str", spy)
    args = sglang_stack.parse(DENSE)
    s = sglang_stack.Stack(SGL, backend, args, str(tmp_path / "store"))
    try:
        _, written = sglang_stack.backup(s.ctl, s.src, s.tokens, s.hashes, Scheduler(False), 30)
        assert written == len(s.tokens)
        threads.clear()
        _, done, idx = sglang_stack.prefetch(s.ctl, s.hp, [(s.tokens, None)], Scheduler(False), 30)
        assert done == [len(s.tokens)]
        s.check(idx[0], done[0])
        assert s.wrong_pages == 0
        s.hp.free(idx[0])
        on_caller = threading.get_ident() in threads
        assert len(threads) == 1 and on_caller == (backend == "mp"), threads
    finally:
        s.close()


@pytest.fixture(scope="module")
def two_tp_ranks():
    """Two TP rank processes (fastpath_rank.py), each running stock and then
    the fast path in turn: one SGLang import and one gloo group per rank serve
    both variants (the import is most of a rank's time). Started with the
    session where it could (tests/early.py, "fastpath_ranks"). Returns the
    exit codes, the ranks' stderr tails and where their result files are;
    none of their processes may outlive them."""
    import pathlib
    with early.finished("fastpath_ranks") as (run, rcs, errs):
        yield rcs, errs, pathlib.Path(run.dir)


@pytest.mark.parametrize("variant", ["stock", "fast"])
def test_two_tp_ranks_agree_through_the_fast_path(two_tp_ranks, variant):
    """Two TP ranks in their own processes, joined in a gloo group that is
    SGLang's TP group: their hit queries and acks are agreed across them
    (MIN), stock and with the fast path (whose hit query then stays on the
    prefetch thread, and whose acks are reduced on the I/O thread). Rank 1
    stored 100 of the 160 pages, so both ranks load exactly 100, bytes
    checked; neither hangs. Both variants run in the same two processes
    (the two_tp_ranks fixture: stock first, before install(), then fast),
    each on its own store, with its own result files."""
    import json
    rcs, errs, tmp = two_tp_ranks
    files = [tmp / f"r{r}.json.{variant}" for r in (0, 1)]
    assert all(f.exists() for f in files), (variant, rcs, errs)
    res = [json.loads(f.read_text()) for f in files]
    for r in res:
        assert r["done"] == 100 * r["page_tokens"] and r["checked"] == 100 and r["wrong"] == 0, res
    assert rcs == [0, 0], errs
