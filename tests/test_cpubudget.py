"""hicache_mp.engine.cpubudget and the auto worker count in a container's CPU limit.

The rule (decision 89): CPUs = min(host cores, affinity mask, floor(quota)),
the quota the tightest of the cgroup and its ancestors (v1 and v2). The
cgroup files are read from trees laid in a directory; the affinity and the
real quota run in child processes (sched_setaffinity; a child cgroup this
test makes, where the machine lets it). A machine is made to look bigger
than its limit with HICACHE_MP_NODE_CORES, which sets the host's count but
never lifts a mask or a quota.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from hicache_mp.bench.cgroups import QuotaCgroup
from hicache_mp.engine.cpubudget import CpuBudget, Quota, read_budget, read_quota, read_throttle
from hicache_mp.engine.nodebudget import NodeBudget, scheduler_cores
from cgroupkit import V1_MOUNTS, V2_MOUNT, lay

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- cgroup trees laid in a directory (cgroupkit) -------------------------------------
def test_v2_the_tightest_of_the_leaf_and_its_ancestors_binds(tmp_path):
    root = lay(tmp_path, {
        "proc/self/mountinfo": V2_MOUNT,
        "proc/self/cgroup": "0::/kubepods/pod1/ctr\n",
        "sys/fs/cgroup/cpu.max": "max 100000\n",
        "sys/fs/cgroup/kubepods/cpu.max": "max 100000\n",
        "sys/fs/cgroup/kubepods/pod1/cpu.max": "250000 100000\n",   # the pod: 2.5 CPUs
        "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max": "600000 100000\n",  # the container: 6
    })
    q = read_quota(root)
    assert q.cpus == 2.5 and q.version == 2
    assert q.directory == os.path.join(root, "sys/fs/cgroup/kubepods/pod1")
    b = read_budget(root, affinity=64, host_cores=64, environ={})
    assert b.cpus == 2 and "cpu.max 250000 100000" in b.source   # floored, not rounded up


def test_v2_a_leaf_tighter_than_its_parent_and_max_everywhere(tmp_path):
    files = {"proc/self/mountinfo": V2_MOUNT, "proc/self/cgroup": "0::/a/b\n",
             "sys/fs/cgroup/a/cpu.max": "800000 100000\n",
             "sys/fs/cgroup/a/b/cpu.max": "300000 100000\n"}
    assert read_quota(lay(tmp_path / "x", files)).cpus == 3
    files["sys/fs/cgroup/a/cpu.max"] = files["sys/fs/cgroup/a/b/cpu.max"] = "max 100000\n"
    root = lay(tmp_path / "y", files)
    assert read_quota(root) is None
    b = read_budget(root, affinity=16, host_cores=16, environ={})
    assert (b.cpus, b.quota) == (16, None)


def test_v2_in_a_cgroup_namespace_the_mount_is_the_container(tmp_path):
    # A container sees "0::/" and its own cgroup mounted at /sys/fs/cgroup.
    root = lay(tmp_path, {"proc/self/mountinfo": V2_MOUNT, "proc/self/cgroup": "0::/\n",
                          "sys/fs/cgroup/cpu.max": "400000 100000\n"})
    assert read_budget(root, affinity=16, host_cores=16, environ={}).cpus == 4


def test_v2_mount_root_below_the_hierarchy(tmp_path):
    # The host path is longer than what the mount shows: the mount's root is the container.
    info = "30 23 0:27 /kubepods/pod9 /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
    root = lay(tmp_path, {"proc/self/mountinfo": info, "proc/self/cgroup": "0::/kubepods/pod9/c\n",
                          "sys/fs/cgroup/cpu.max": "200000 100000\n",
                          "sys/fs/cgroup/c/cpu.max": "max 100000\n"})
    q = read_quota(root)
    assert q.cpus == 2 and q.directory == os.path.join(root, "sys/fs/cgroup")


def test_v1_quota_period_nested_and_unlimited(tmp_path):
    files = {"proc/self/mountinfo": V1_MOUNTS,
             "proc/self/cgroup": "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n",
             "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
             "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
             "sys/fs/cgroup/cpu,cpuacct/docker/cpu.cfs_quota_us": "150000\n",
             "sys/fs/cgroup/cpu,cpuacct/docker/cpu.cfs_period_us": "50000\n",   # 3 CPUs
             "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "-1\n",
             "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"}
    root = lay(tmp_path / "a", files)
    q = read_quota(root)
    assert (q.cpus, q.version, q.text) == (3, 1, "150000/50000")
    assert read_budget(root, affinity=32, host_cores=32, environ={}).cpus == 3
    files["sys/fs/cgroup/cpu,cpuacct/docker/cpu.cfs_quota_us"] = "-1\n"
    assert read_quota(lay(tmp_path / "b", files)) is None


def test_no_cgroup_at_all_and_a_quota_below_one_cpu(tmp_path):
    bare = lay(tmp_path / "bare", {"proc/self/mountinfo": "", "proc/self/cgroup": ""})
    assert read_quota(bare) is None
    assert read_budget(str(tmp_path / "nothing"), affinity=8, host_cores=8, environ={}).cpus == 8
    small = lay(tmp_path / "small", {"proc/self/mountinfo": V2_MOUNT, "proc/self/cgroup": "0::/\n",
                                     "sys/fs/cgroup/cpu.max": "50000 100000\n"})
    b = read_budget(small, affinity=8, host_cores=8, environ={})
    assert b.cpus == 1 and "below one CPU" in b.source


def test_node_cores_sets_the_host_never_lifts_the_quota(tmp_path):
    root = lay(tmp_path, {"proc/self/mountinfo": V2_MOUNT, "proc/self/cgroup": "0::/\n",
                          "sys/fs/cgroup/cpu.max": "400000 100000\n"})
    assert read_budget(root, affinity=64, host_cores=64,
                       environ={"HICACHE_MP_NODE_CORES": "2"}).cpus == 2
    b = read_budget(root, affinity=64, host_cores=64, environ={"HICACHE_MP_NODE_CORES": "32"})
    assert b.cpus == 4 and b.host_cores == 32
    with pytest.raises(ValueError, match="HICACHE_MP_NODE_CORES"):
        read_budget(root, environ={"HICACHE_MP_NODE_CORES": "four"})


def test_throttle_counters_v1_and_v2(tmp_path):
    v2 = lay(tmp_path / "v2", {"cpu.stat": "usage_usec 10\nnr_periods 50\nnr_throttled 7\n"
                                           "throttled_usec 12500\n"})
    v1 = lay(tmp_path / "v1", {"cpu.stat": "nr_periods 9\nnr_throttled 3\nthrottled_time 4000000\n"})
    assert read_throttle(v2) == {"periods": 50, "throttled": 7, "throttled_ms": 12.5}
    assert read_throttle(v1) == {"periods": 9, "throttled": 3, "throttled_ms": 4.0}
    assert read_throttle(str(tmp_path / "none")) is None


# --- the workers' split --------------------------------------------------------------
def test_scheduler_keeps_one_core_in_a_small_budget_two_in_a_large_one():
    assert scheduler_cores(4) == 1 and scheduler_cores(8) == 1
    assert scheduler_cores(16) == 2 and scheduler_cores(128) == 2


def test_pods_split_their_own_quota_and_share_the_hosts_cores(tmp_path):
    """Three engines on one registry (a hostPath): two in pod A (4 CPUs), one in
    pod B (4 CPUs), on a 16-core host."""
    pod_a, pod_b = tmp_path / "podA", tmp_path / "podB"
    pod_a.mkdir()
    pod_b.mkdir()

    def budget(pod):
        return CpuBudget(4, f"quota of {pod.name}", 16, 16, Quota(4.0, 2, str(pod), "400000 100000"))

    node = str(tmp_path / "node")
    shares = []
    try:
        shares.append(NodeBudget(0, directory=node, budget=budget(pod_a)))
        shares.append(NodeBudget(0, directory=node, budget=budget(pod_b)))
        shares.append(NodeBudget(0, directory=node, budget=budget(pod_a)))
        # pod A's first engine takes its quota less one core; pod B is not
        # squeezed by pod A; pod A's late second engine gets the floor of one
        assert [s.workers for s in shares] == [3, 3, 1]
        # an engine with the whole host beside them counts all three: four
        # schedulers keep 8 of the 16 cores, the pods took 7 of the other 8
        shares.append(NodeBudget(0, directory=node, cores=16))
        assert shares[-1].workers == 1
    finally:
        for s in shares:
            s.close()
    assert not os.path.exists(node)


# --- real processes: a mask, a quota ---------------------------------------------------
CHILD = textwrap.dedent("""
    import json, logging, os, sys
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    mask = json.loads(sys.argv[2])
    if mask:
        os.sched_setaffinity(0, set(mask))
    from hicache_mp import EngineConfig, PrefetchEngine
    from shm import PageGeometry
    cfg = EngineConfig(storage_dir=sys.argv[1], num_workers=int(sys.argv[3]), host_pool_pages=4)
    with PrefetchEngine(cfg, PageGeometry(num_layers=1, num_kv_heads=1, head_dim=8,
                                          page_size=4)) as eng:
        m = eng.metrics()
        print(json.dumps({"workers": m["workers"], "cpu": m["cpu"]}), flush=True)
""")


def run_child(store, *, mask=(), workers=0, cores="16", preexec=None) -> tuple[dict, str]:
    env = dict(os.environ, HICACHE_MP_NODE_CORES=cores,
               HICACHE_MP_NODE_DIR=os.path.join(store, "node"))
    p = subprocess.run([sys.executable, "-c", CHILD, store, json.dumps(list(mask)), str(workers)],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
                       preexec_fn=preexec)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def test_affinity_of_one_cpu_on_a_host_that_looks_like_16_cores(store):
    """Before decision 89 the mask was not read: auto started 14 workers here."""
    out, err = run_child(store, mask=[0])
    assert out["workers"] == 1
    assert out["cpu"]["cpus"] == 1 and out["cpu"]["source"].startswith("affinity: 1 of")
    assert out["cpu"]["host_cores"] == 16
    assert "above this process's CPU budget" not in err


def test_an_explicit_count_above_the_budget_is_logged_once_naming_it(store):
    out, err = run_child(store, mask=[0], workers=3)
    assert out["workers"] == 3  # the user's count stands
    lines = [ln for ln in err.splitlines() if "above this process's CPU budget" in ln]
    assert len(lines) == 1, err
    assert "num_workers=3" in lines[0] and "1 CPU(s) (affinity: 1 of" in lines[0]
    assert "--hicache-mp-workers 0" in lines[0]


def test_a_real_quota_sizes_the_engine_and_its_throttling_shows(store):
    why = QuotaCgroup.unavailable()
    if why:
        pytest.skip(f"no child cgroup here: {why}")
    with QuotaCgroup(1.0) as cg:
        out, _ = run_child(store, preexec=cg.enter)
    assert out["workers"] == 1                      # 14 before decision 89
    assert out["cpu"]["cpus"] == 1 and out["cpu"]["quota_cpus"] == 1.0
    assert f"v{cg.version}" in out["cpu"]["source"] and cg.path in out["cpu"]["source"]
    assert out["cpu"]["throttle"]["cgroup"] == cg.path


THROTTLED = textwrap.dedent("""
    import logging, os, subprocess, sys, time
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from hicache_mp.engine.cpubudget import ThrottleWatch, read_budget
    # Into the cgroup once imported (an interpreter's start at a fifth of a CPU
    # is most of a second), before anything reads or spins in it.
    with open(sys.argv[2], "w") as f:
        f.write(str(os.getpid()))
    assert sys.argv[3] in open("/proc/self/cgroup").read()
    budget = read_budget()
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # in the cgroup too
    # the spinning process stands for the I/O workers, or for other work of the pod
    pids = (lambda: []) if sys.argv[1] == "other" else (lambda: [spin.pid])
    auto = sys.argv[1] == "auto-one"   # auto, which gave one worker: no fewer to give
    watch = ThrottleWatch(budget, workers=1 if auto else 3, pids=pids, auto=auto,
                          interval_s=0.3)
    try:
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            watch.maybe_check()
    finally:
        spin.kill()
        spin.wait()
    print(watch.metrics())
""")


@pytest.mark.parametrize("spinner", ["workers", "other", "auto-one"])
def test_a_throttled_cgroup_is_counted_and_warned_of_once_naming_whose_work(spinner):
    """Decision 98: the workers' CPU time in the window decides the fix named.
    Busy workers: fewer of them; busy at auto's one-worker minimum: a higher
    limit. Idle workers in a throttled cgroup: the container's other work, so
    a higher limit, and no blame on the workers."""
    why = QuotaCgroup.unavailable()
    if why:
        pytest.skip(f"no child cgroup here: {why}")
    with QuotaCgroup(0.2) as cg:   # two busy processes in a fifth of a CPU
        p = subprocess.run([sys.executable, "-c", THROTTLED, spinner,
                            os.path.join(cg.path, "cgroup.procs"),
                            os.path.basename(cg.path)],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    counts = eval(p.stdout.strip().splitlines()[-1])  # a dict literal we printed
    assert counts["cgroup"] == cg.path and counts["throttled"] > 0 and counts["throttled_ms"] > 0
    warned = [ln for ln in p.stderr.splitlines() if "CPU-throttled" in ln]
    assert len(warned) == 1, p.stderr
    if spinner == "workers":
        assert "I/O workers were busy" in warned[0] and "--hicache-mp-workers 0" in warned[0]
    elif spinner == "auto-one":
        assert "auto already runs the minimum of one: raise the container's CPU limit" \
            in warned[0] and "--hicache-mp-workers" not in warned[0]
    else:
        assert "other work in this container took the CPU" in warned[0]
        assert "used 0% of it" in warned[0] and "--hicache-mp-workers" not in warned[0]
