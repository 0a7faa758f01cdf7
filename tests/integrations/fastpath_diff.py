"""The differential workload of test_sglang_fastpath: SGLang's real controllers
(dense `HiCacheController`, hybrid `HybridCacheController`) driven as the
scheduler drives them, returning what a run saw (acks, host slots, page
bytes, backup files) so a stock run and a fast-path run can be compared.

Shared by the test module (stock, then install() in the same process) and
fastpath_plugin_child.py (the fast runs in a fresh interpreter where SGLang's
plugin loader installed the fast path). Owns no assertion about stock
against fast; must not install or uninstall the fast path itself.
"""
import hashlib
import os
import threading
import time

from hicache_mp.bench.sglang import real as sglang_real
from hicache_mp.bench.sglang import stack as sglang_stack
from hicache_mp.bench.sglang.handoffs import thread_role
from hicache_mp.bench.sglang.stack import Scheduler

SGL = sglang_real.import_stack()   # ImportError where SGLang's chain cannot load

# 8 KiB pages of 4 tokens; 160 pages: two of SGLang's 128-page batches per request
DENSE = ["--round-mib", "1.25", "--page-mib", "0.0078125", "--layers", "2", "--heads", "4",
         "--head-dim", "64", "--requests", "1", "--workers", "1", "--timeout-s", "30"]
POLICIES = ("wait_complete", "best_effort", "timeout")
HYBRID_POLICIES = ("wait_complete", "best_effort")
# SGLang's storage threads, by target (earlier stacks' threads have been joined)
SGL_THREADS = {"prefetch_thread_func", "prefetch_io_aux_func", "prefetch_sync_thread_func",
               "backup_thread_func"}


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
