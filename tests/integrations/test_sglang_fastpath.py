"""The SGLang storage fast path (hicache_mp.integrations.sglang.fastpath) against
SGLang 0.5.23's stock controller, through SGLang's real classes on CPU.

Differential: the same workload through a stock controller and through one
built after `install()` gives the same acks, the same pages in the same host
slots and the same backup files: dense (`HiCacheController`) on `mp` and on
SGLang's own `file` backend, hybrid (`HybridCacheController`, v2) on `mp` over
Mamba, SWA and DSA, under each prefetch policy as the scheduler plays it
against the controller (wait_complete: never terminated; best_effort:
terminated when the request is scheduled, here before its transfer starts;
timeout: terminated at its deadline, here while the second batch is in
flight). Then SGLang's failure injector over the fast path, install() applied
and refused, and the upstream patch: it is what install() does, and it
applies to a copy of SGLang's installed sources."""
import hashlib
import itertools
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
from hicache_mp.integrations.sglang import fastpath  # noqa: E402

UPSTREAM = os.path.join(os.path.dirname(fastpath.__file__), "upstream")
PATCH = os.path.join(UPSTREAM, "sglang-0.5.23-hicache-fastpath.patch")
SITE = sysconfig.get_paths()["purelib"]
# 8 KiB pages of 4 tokens; 160 pages: two of SGLang's 128-page batches per request
DENSE = ["--round-mib", "1.25", "--page-mib", "0.0078125", "--layers", "2", "--heads", "4",
         "--head-dim", "64", "--requests", "1", "--workers", "1", "--timeout-s", "30"]
POLICIES = ("wait_complete", "best_effort", "timeout")


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
        threads = sorted(t._target.__name__ for t in threading.enumerate()
                         if getattr(t, "_target", None) is not None
                         and getattr(t._target, "__self__", None) is s.ctl and t.is_alive())
        src = [s.page(s.src, i).clone() for i in range(s.pages)]
    finally:
        s.close()
    return rounds, store_files(store), src, threads


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
    full = len(src) * len(stock[0]["wait_complete"][1]) // len(src)   # tokens of every page
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
def hybrid_run(geom, store, policies):
    from hicache_mp.bench.sglang import hybrid_rank, real_hybrid
    S = real_hybrid.load()
    hybrid_rank._ids = itertools.count(1)   # the same token ids (so keys) in every run
    r = hybrid_rank.Rank(S, real_hybrid.geometry(geom, tiny=True), "mp", store, requests=1,
                         max_pages=4, workers=1)
    out = {}
    try:
        assert r.backup(4, Scheduler(False), 30)
        for policy in policies:
            ctl, deadline, sched = r.ctl, time.monotonic() + 30, Scheduler(False)
            gate = Gate(ctl, "batch_get_v1", 1) if policy != "wait_complete" else None
            key = r.prefix(4, 0)[0]
            handle = r.Handle(rid=f"h-{policy}", attempt_id=0)
            ctl.prefetch(handle, key, None, None, extra_pools=r._prefetch_transfers() or None)
            op = sched.get(ctl.prefetch_hit_queue, deadline)
            assert r._stage(op)
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
                r.finish(4, {handle.rid: [0, op, acks[0][0]]}, policy)
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


@pytest.mark.parametrize("geom", ["mamba", "swa", "dsa"])
def test_hybrid_same_as_stock(tmp_path, geom):
    policies = ("wait_complete", "best_effort")
    stock = hybrid_run(geom, str(tmp_path / "stock"), policies)
    fastpath.install()
    fast = hybrid_run(geom, str(tmp_path / "fast"), policies)
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
    changed = fastpath.install()
    assert sorted(changed) == sorted(
        [f"replaced sglang.srt.managers.cache_controller.HiCacheController.{m}" for m in
         ("_page_transfer", "prefetch_io_aux_func", "prefetch_sync_thread_func",
          "_sync_prefetch_hit_query", "_reduce_prefetch_ack")] +
        ["added sglang.srt.managers.cache_controller.HiCacheController._publish_prefetch_ack"] +
        [f"replaced sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller."
         f"HybridCacheController.{m}" for m in
         ("_page_transfer_sidecar", "_reduce_prefetch_ack", "prefetch_sync_thread_func")] +
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


# --- the upstream patch -------------------------------------------------------------------
def test_patch_is_install_and_applies(tmp_path):
    """The shipped patch is what install() does (generated from the same
    methods) and applies cleanly to a copy of SGLang 0.5.23's installed sources;
    the patched files compile and hold install()'s methods."""
    from hicache_mp.integrations.sglang import fastpath_methods
    with open(PATCH) as f:
        assert f.read() == fastpath.patch_text(SITE), \
            "stale patch: run python3 scripts/sglang_fastpath_patch.py"
    rels = [m.replace(".", "/") + ".py" for m, *_ in fastpath_methods.TARGETS]
    for rel in rels:
        os.makedirs(tmp_path / os.path.dirname(rel), exist_ok=True)
        shutil.copy(os.path.join(SITE, rel), tmp_path / rel)
    tool = shutil.which("patch")
    cmd = ([tool, "-p1", "--dry-run", "-i", PATCH] if tool else
           ["git", "apply", "--check", "-p1", PATCH])
    subprocess.run(cmd, cwd=tmp_path, check=True, capture_output=True)
    subprocess.run([tool, "-p1", "-s", "-i", PATCH] if tool else ["git", "apply", "-p1", PATCH],
                   cwd=tmp_path, check=True, capture_output=True)
    for (mod, cls, holder, anchor), rel in zip(fastpath_methods.TARGETS, rels):
        text = (tmp_path / rel).read_text()
        compile(text, rel, "exec")
        with open(os.path.join(SITE, rel)) as f:
            assert text == fastpath.patched_source(f.read(), cls, holder, anchor)
        assert "hicache_mp" not in text   # every backend gains; nothing of ours in it
