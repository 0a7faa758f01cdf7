"""A host pool larger than the memory cgroup's limit is refused with a clear error.

The pool is shared memory, and shared memory is charged to the memory cgroup
of the process that makes it. A pool that fits /dev/shm and the machine but
not the pod's memory limit got the engine OOM-killed while it was made,
with no message. Now `check_pool_size` also reads the limit of this
process's cgroup and of every ancestor (cgroup v2 `memory.max`, v1
`memory.limit_in_bytes`, where a huge value means none) and refuses first,
naming the limit, where it is set, and the fixes.

The cgroup files are read from trees laid in a directory (as
tests/test_cpubudget.py does), and once from a real memory cgroup this test
makes below its own (v2 where the unified hierarchy has the memory
controller, else v1), with an engine constructed in a child process moved
into it; the cgroup is removed after, and nothing is left in /dev/shm.
"""
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from hicache_mp.bench.cgroups import remove_cgroup
from hicache_mp.engine.checks import check_pool_size, memory_limit
from hicache_mp.engine.cpubudget import cgroup_levels, read_text
from cgroupkit import V1_MOUNTS, V2_MOUNT, lay

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB, GiB = 1 << 20, 1 << 30
V1_NONE = "9223372036854771712\n"  # what v1 writes for "no limit" (4 KiB pages)


def test_v2_the_pod_limit_above_the_container_binds(tmp_path):
    root = lay(tmp_path, {
        "proc/self/mountinfo": V2_MOUNT,
        "proc/self/cgroup": "0::/kubepods/pod1/ctr\n",
        "sys/fs/cgroup/memory.max": "max\n",   # the root has none (and no file, really)
        "sys/fs/cgroup/kubepods/pod1/memory.max": f"{GiB}\n",
        "sys/fs/cgroup/kubepods/pod1/ctr/memory.max": "max\n",
    })
    lim = memory_limit(root)
    assert lim.nbytes == GiB and lim.version == 2
    assert lim.directory == os.path.join(root, "sys/fs/cgroup/kubepods/pod1")
    check_pool_size(GiB // 2, root=root)           # fits: no error
    with pytest.raises(ValueError) as exc:
        check_pool_size(2 * GiB, root=root)
    msg = str(exc.value)
    for words in ("2.0 GiB", "1.0 GiB", "memory.max", lim.directory, "host_pool_pages",
                  "page size", "memory limit", "OOM"):
        assert words in msg, (words, msg)


def test_v2_none_anywhere_and_in_a_cgroup_namespace(tmp_path):
    free = lay(tmp_path / "a", {"proc/self/mountinfo": V2_MOUNT, "proc/self/cgroup": "0::/x\n",
                                "sys/fs/cgroup/x/memory.max": "max\n"})
    assert memory_limit(free) is None
    check_pool_size(8 * GiB, root=free)
    # A container sees "0::/" and its own cgroup mounted at /sys/fs/cgroup.
    ns = lay(tmp_path / "b", {"proc/self/mountinfo": V2_MOUNT, "proc/self/cgroup": "0::/\n",
                              "sys/fs/cgroup/memory.max": f"{512 * MiB}\n"})
    assert memory_limit(ns).nbytes == 512 * MiB
    with pytest.raises(ValueError, match="512 MiB"):
        check_pool_size(GiB, root=ns)


def test_v1_a_limit_and_the_huge_value_that_means_none(tmp_path):
    files = {"proc/self/mountinfo": V1_MOUNTS,
             "proc/self/cgroup": "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n",
             "sys/fs/cgroup/memory/memory.limit_in_bytes": V1_NONE,
             "sys/fs/cgroup/memory/docker/memory.limit_in_bytes": V1_NONE,
             "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": f"{256 * MiB}\n"}
    root = lay(tmp_path / "limited", files)
    lim = memory_limit(root)
    assert (lim.nbytes, lim.version) == (256 * MiB, 1)
    with pytest.raises(ValueError) as exc:
        check_pool_size(GiB, root=root)
    assert "memory.limit_in_bytes" in str(exc.value) and "256 MiB" in str(exc.value)
    files["sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes"] = V1_NONE
    assert memory_limit(lay(tmp_path / "none", files)) is None


def test_no_cgroup_mounted_or_files_unreadable_is_no_limit(tmp_path):
    assert memory_limit(lay(tmp_path / "a", {"proc/self/mountinfo": "",
                                             "proc/self/cgroup": ""})) is None
    garbled = lay(tmp_path / "b", {"proc/self/mountinfo": V2_MOUNT, "proc/self/cgroup": "0::/\n",
                                   "sys/fs/cgroup/memory.max": "lots\n"})
    assert memory_limit(garbled) is None


# --- a real memory cgroup ------------------------------------------------------------
PREFIX = "hicache_mp_test_mem."


def _own_memory_cgroup() -> tuple[int, str] | tuple[None, str]:
    """(version, this process's memory cgroup directory) where a child cgroup
    can be made in it, else (None, why not)."""
    if os.geteuid() != 0:
        return None, "making a cgroup needs root"
    for version, directory in cgroup_levels("memory"):
        if version == 2:
            if "memory" not in (read_text(os.path.join(directory, "cgroup.controllers")) or ""):
                continue  # the unified hierarchy without the memory controller (hybrid)
            if read_text(os.path.join(directory, "cgroup.procs")):
                # v2's no-internal-process rule: a child with a controller needs a leaf parent
                continue
        if os.access(directory, os.W_OK):
            return version, directory
    return None, "no writable memory cgroup (v2 with the memory controller, or v1) holds this process"


BODY = textwrap.dedent("""
    import json, os, sys
    sys.path[:0] = sys.argv[2].split(os.pathsep)
    with open(sys.argv[3], "w") as f:   # into the cgroup before anything is allocated
        f.write(str(os.getpid()))
    from faultkit import MID, make
    from shm.names import list_ours
    out = {}
    try:
        make(sys.argv[1], geo=MID, pages=int(sys.argv[4]), workers=1).close()
        out["error"] = None
    except Exception as exc:
        out["error"], out["type"] = str(exc), type(exc).__name__
    out["left"] = [n for n in list_ours() if f".{os.getpid()}." in n]
    print("RESULT " + json.dumps(out), flush=True)
""")


def test_an_engine_in_a_real_memory_cgroup_too_small_for_its_pool_is_refused(store):
    version, parent = _own_memory_cgroup()
    if version is None:
        pytest.skip(parent)
    path = os.path.join(parent, f"{PREFIX}{os.getpid()}.{time.monotonic_ns()}")
    os.mkdir(path)
    limit = 160 * MiB   # an interpreter with numpy fits; a 256 MiB pool does not
    try:
        name = "memory.max" if version == 2 else "memory.limit_in_bytes"
        with open(os.path.join(path, name), "w") as f:
            f.write(str(limit))
        pages = 256 * MiB // (64 * 1024)  # MID pages are 64 KiB
        paths = os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "faults")])
        proc = subprocess.run([sys.executable, "-c", BODY, store, paths,
                               os.path.join(path, "cgroup.procs"), str(pages)],
                              capture_output=True, text=True, timeout=120)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        assert proc.returncode == 0 and line, \
            f"the child died (rc {proc.returncode}: -9 is the OOM killer):\n{proc.stderr[-3000:]}"
        got = json.loads(line[0][len("RESULT "):])
    finally:
        remove_cgroup(path)
        from shm.names import clean_stale
        clean_stale()  # what a child killed while it made its pool left (the unfixed code)
    assert got["type"] == "ValueError", got
    for words in (name, path, "160 MiB", "host_pool_pages", "memory limit"):
        assert words in got["error"], (words, got["error"])
    assert got["left"] == [], got["left"]
    assert not os.path.exists(path)
