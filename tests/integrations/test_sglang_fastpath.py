"""The SGLang storage fast path (hicache_mp.integrations.sglang.fastpath) against
SGLang 0.5.23's stock controller, through SGLang's real classes on CPU.

- Differential: the same workload through a stock controller and through one
  built after `install()` gives the same acks, the same pages in the same host
  slots and the same backup files. Dense (`HiCacheController`) on `mp` and
  SGLang's `file`, under each prefetch policy as the scheduler plays it
  against the controller (wait_complete: never terminated; best_effort:
  terminated when scheduled, here before its transfer starts; timeout:
  terminated at its deadline, here while the second batch is in flight).
  Hybrid (`HybridCacheController`, v2) over Mamba, SWA and DSA on `mp` and
  `file`, never terminated and terminated while its KV batch is in flight.
- SGLang's failure injector over the fast path: no wrong page, no hang.
- The hand-offs: at most one SGLang-side wait per batch on its storage threads.
- install() applied, idempotent, undone, and refused (another version, or an
  0.5.23 whose methods differ); the upstream patch is what install() does and
  applies to a copy of SGLang's installed sources; the `sglang-serve` launcher.

Reaches inside: SGLang's `HiCacheController._reduce_prefetch_ack` and
`HybridCacheController._page_transfer_sidecar`, private methods of SGLang's
controllers that install() replaces: the test reads them to see them replaced
and restored, and swaps one for a stand-in to show install() refuses an
0.5.23 whose methods are not the ones the fast path was built from.
"""
import hashlib
import os
import shutil
import subprocess
import sysconfig
import threading
import time

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
from hicache_mp.bench.sglang.handoffs import thread_role  # noqa: E402
from hicache_mp.integrations.sglang import fastpath  # noqa: E402

UPSTREAM = os.path.join(os.path.dirname(fastpath.__file__), "upstream")
PATCH = os.path.join(UPSTREAM, "sglang-0.5.23-hicache-fastpath.patch")
SITE = sysconfig.get_paths()["purelib"]
# 8 KiB pages of 4 tokens; 160 pages: two of SGLang's 128-page batches per request
DENSE = ["--round-mib", "1.25", "--page-mib", "0.0078125", "--layers", "2", "--heads", "4",
         "--head-dim", "64", "--requests", "1", "--workers", "1", "--timeout-s", "30"]
POLICIES = ("wait_complete", "best_effort", "timeout")
# SGLang's storage threads, by target (earlier stacks' threads have been joined)
SGL_THREADS = {"prefetch_thread_func", "prefetch_io_aux_func", "prefetch_sync_thread_func",
               "backup_thread_func"}


@pytest.fixture(autouse=True)
def _stock_after():
    yield
    fastpath.uninstall()


class Gate:
    """Holds the backend's Nth get of a round until the test has terminated
    the prefetch, so 'terminated while batch N is in flight' is the same point
    in every run (the backend's call is wrapped; the controller is not)."""

    def __init__(self, ctl, name, hold_call):
        self.arrived, self.go, self.n, self.hold = threading.Event(), threading.Event(), 0, hold_call
        be = ctl.storage_backend
        fn = getattr(be, name)

        def gated(*a, **k):
            self.n += 1
            if self.n == self.hold:
                self.arrived.set()
                self.go.wait(10)
            return fn(*a, **k)
        setattr(be, name, gated)


def dense_round(s, policy):
    """One prefetch of the whole sequence as the scheduler plays `policy`:
    (acks [(completed_tokens, completed_req)], host slots, pages' bytes)."""
    ctl, hp, deadline = s.ctl, s.hp, time.monotonic() + 30
    get_name = "batch_get" if s.name == "file" else "batch_get_v1"
    gate = Gate(ctl, get_name, 2) if policy == "timeout" else None
    sched = Scheduler(False)
    op = ctl.prefetch("r", s.tokens, None)
    hit = sched.get(ctl.prefetch_hit_queue, deadline)
    assert hit is op and op.storage_hit_count == len(s.tokens)
    op.host_indices = hp.alloc(op.storage_hit_count)
    if policy == "best_effort":
        ctl.terminate_prefetch(op)   # scheduled before its transfer began
    ctl.prefetch_buffer.put(op)
    if gate is not None:
        assert gate.arrived.wait(10)
        ctl.terminate_prefetch(op)   # the deadline passed during the second batch
        gate.go.set()
    acks = []
    while not acks or not acks[-1][1]:
        a = sched.get(ctl.ack_prefetch_queue, deadline)
        acks.append((a.completed_tokens, bool(a.completed_req)))
    done = max([t for t, _ in acks if t is not None] + [0])
    pages = [s.page(op.host_indices, i).clone() for i in range(done // s.P)]
    slots = op.host_indices.tolist()
    hp.free(op.host_indices)
    return acks, slots, pages


def store_files(root):
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def dense_run(backend, store, policies):
    args = sglang_stack.parse(DENSE)
    s = sglang_stack.Stack(SGL, backend, args, store)
    try:
        t, written = sglang_stack.backup(s.ctl, s.src, s.tokens, s.hashes, Scheduler(False), 30)
        assert written == len(s.tokens)
        rounds = {p: dense_round(s, p) for p in policies}
        threads = sorted(r for r in map(thread_role, threading.enumerate()) if r in SGL_THREADS)
        src = [s.page(s.src, i).clone() for i in range(s.pages)]
    finally:
        s.close()
    return rounds, store_files(store), src, threads


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


@pytest.mark.parametrize("backend", ["mp", "file"])
def test_dense_same_as_stock(tmp_path, backend):
    stock = dense_run(backend, str(tmp_path / "stock"), POLICIES)
    changed = fastpath.install()
    assert "added sglang.srt.managers.cache_controller.HiCacheController._publish_prefetch_ack" \
        in changed
    fast = dense_run(backend, str(tmp_path / "fast"), POLICIES)
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


# --- hybrid: HybridCacheController, batch_exists_v2 / batch_get_v2 ----------------------
def hybrid_transfers(r, prefetch: bool, src=None, hashes=None):
    """The PoolTransfers the components build (hybrid_rank's docstring says
    which): for BACKUP_STORAGE with the src slots and the last hashes, for a
    PREFETCH with placeholder keys."""
    T, N, out = r.T, r.N, []
    if r.pools.mamba is not None:
        out.append(T(name=N.MAMBA, keys=["__placeholder__"] if prefetch else hashes[-1:],
                     host_indices=None if prefetch else src["mamba"], hit_policy=r.TRAIL))
    if r.pools.swa is not None:
        out.append(T(name=N.SWA, keys=["__placeholder__"] * r.W if prefetch else hashes[-r.W:],
                     host_indices=None if prefetch else src["swa"], hit_policy=r.TRAIL))
    if r.pools.indexer is not None:
        out.append(T(name=N.INDEXER, indices_from_pool=N.KV, keys=None if prefetch else hashes))
    return out


def hybrid_stage(r, op) -> None:
    """The scheduler's hit drain: KV staging, each sidecar's, then the I/O queue."""
    ctl, hit = r.ctl, op.storage_hit_count
    host, n = ctl.allocate_storage_hit(op, hit, allow_partial=True,
                                       min_tokens=ctl.prefetch_threshold,
                                       evict_host=lambda tokens: 0)
    assert host is not None and n == hit
    for t in op.pool_transfers or ():
        if t.host_indices is None and not t.indices_from_pool:
            pool = r.group.get_pool(t.name)
            t.host_indices = pool.alloc(min(len(t.keys), n // r.P) * pool.page_size)
    op.host_indices = host
    ctl.prefetch_buffer.put(op)


def hybrid_run(geom, backend, store, policies, pages=4):
    from array import array
    from hicache_mp.bench.sglang import hybrid_controller, hybrid_rank, real_hybrid
    g = real_hybrid.geometry(geom, tiny=True)
    r = hybrid_rank.Rank(real_hybrid.load(), g, "mp", store, requests=1, max_pages=pages,
                         workers=1)   # its pools, src pages and checks; mp's controller
    if backend == "file":   # the same pools behind a controller on SGLang's own file backend
        r.close()
        r.group, r.ctl = hybrid_controller.build(r.pools, g, backend="file",
                                                 extra={"file_storage_path": store},
                                                 model=f"hicache-mp/{geom}")
    key = r.Key(array("q", range(1000, 1000 + pages * r.P)))   # the same keys in every run
    hashes = r.hash(key, None, page_size=r.P)
    out = {}
    try:
        src = r.src_of(0, pages)
        op_id = r.ctl.write_storage(src["kv"], list(key.token_ids), hashes, None,
                                    extra_pools=hybrid_transfers(r, False, src, hashes) or None)
        done = Scheduler(False).get(r.ctl.ack_backup_queue, time.monotonic() + 30)
        assert done.id == op_id and done.completed_tokens == pages * r.P
        for policy in policies:
            ctl, deadline, sched = r.ctl, time.monotonic() + 30, Scheduler(False)
            gate = (Gate(ctl, "batch_get" if backend == "file" else "batch_get_v1", 1)
                    if policy != "wait_complete" else None)
            handle = r.Handle(rid=f"h-{policy}", attempt_id=0)
            ctl.prefetch(handle, key, None, None, extra_pools=hybrid_transfers(r, True) or None)
            op = sched.get(ctl.prefetch_hit_queue, deadline)
            hybrid_stage(r, op)
            if gate is not None:   # terminated (best_effort: scheduled; timeout: deadline)
                assert gate.arrived.wait(10)   # while its KV batch is in flight
                ctl.terminate_prefetch(op)
                gate.go.set()
            acks = []
            while not acks or not acks[-1][2]:
                a = sched.get(ctl.ack_prefetch_queue, deadline)
                acks.append((a.completed_tokens, dict(a.pool_hits) if a.pool_hits is not None
                             else None, bool(a.completed_req)))
            slots = {"kv": op.host_indices.tolist()}
            for t in op.pool_transfers or ():
                if t.host_indices is not None and not t.indices_from_pool:
                    slots[t.name.value] = t.host_indices.tolist()
            if policy == "wait_complete":   # every KV and sidecar page checked, then freed
                r.finish(pages, {handle.rid: [0, op, acks[0][0]]}, policy)
            else:   # the sidecar was skipped by design: its staging only freed
                r.group.free(op.host_indices)
                for t in op.pool_transfers or ():
                    if t.host_indices is not None and not t.indices_from_pool:
                        r.group.get_pool(t.name).free(t.host_indices)
            out[policy] = (acks, slots)
        out["wrong"], out["checked"] = r.wrong, r.checked
        out["files"] = store_files(store)
    finally:
        r.close()
    return out


@pytest.mark.parametrize("backend", ["mp", "file"])
@pytest.mark.parametrize("geom", ["mamba", "swa", "dsa"])
def test_hybrid_same_as_stock(tmp_path, geom, backend):
    policies = ("wait_complete", "best_effort")
    stock = hybrid_run(geom, backend, str(tmp_path / "stock"), policies)
    fastpath.install()
    fast = hybrid_run(geom, backend, str(tmp_path / "fast"), policies)
    for p in policies:
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


# --- the launcher: hicache-mp sglang-serve -- <launch_server args> -------------------------
def test_sglang_serve_launcher(capsys):
    import pickle
    from hicache_mp import cli
    from hicache_mp.integrations.sglang import serve
    with pytest.raises(SystemExit) as e:
        cli.main(["sglang-serve", "--help"])
    assert e.value.code == 0 and "LAUNCH_SERVER_ARGS" in capsys.readouterr().out
    # another SGLang: refused before anything starts, nothing patched
    assert serve.main(["--model-path", "x"], version="0.6.0") == 2
    assert "built and tested for SGLang 0.5.23" in capsys.readouterr().err
    assert not fastpath.installed()
    # the arguments after -- reach SGLang's own parser, after the install
    with pytest.raises(SystemExit) as e:
        cli.main(["sglang-serve", "--", "--help"])
    assert e.value.code == 0 and fastpath.installed()
    out = capsys.readouterr()
    assert "--model-path" in out.out and "fast path installed" in out.err
    # SGLang spawns its schedulers: the entry it is given travels by name
    assert pickle.loads(pickle.dumps(serve.run_scheduler_process)) is serve.run_scheduler_process


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
def two_tp_ranks(tmp_path_factory):
    """Two TP rank processes (fastpath_rank.py), each running stock and then
    the fast path in turn: one SGLang import and one gloo group per rank serve
    both variants (the import is most of a rank's time). Returns the exit
    codes, the ranks' stderr tails and where their result files are."""
    import subprocess
    import sys
    tmp = tmp_path_factory.mktemp("tp_ranks")
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root, here, os.environ.get("PYTHONPATH", "")]))
    pg, store = tmp / "pg", tmp / "store"
    procs = [subprocess.Popen([sys.executable, os.path.join(here, "fastpath_rank.py"), str(r),
                               "2", str(pg), str(store), str(tmp / f"r{r}.json"), "stock,fast",
                               str(160 if r == 0 else 100)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for r in (0, 1)]
    errs = []
    try:
        for p in procs:
            errs.append(p.communicate(timeout=180)[1].decode(errors="replace")[-3000:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs], errs, tmp


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
