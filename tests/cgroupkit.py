"""cgroup trees laid in a directory, for the tests of what the engine reads
from cgroups (CPU quota, memory limit): a /proc/self/{mountinfo,cgroup} and
a /sys/fs/cgroup below a tmp_path root, which the readers take as `root`."""
import os


def lay(root, files: dict) -> str:
    """Write `files` ({path below root: text}) and return root as a str."""
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    return str(root)


V2_MOUNT = "30 23 0:27 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNTS = ("40 23 0:33 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
             "41 23 0:34 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory\n")


def memory_level(version: int, cgroup: str, *, limit=None, usage=None,
                 inactive_file=None, mount: str = "") -> dict:
    """The memory files of one cgroup in a laid tree ({path below root: text},
    for lay()): `cgroup` below the memory hierarchy's mount (v2
    /sys/fs/cgroup, v1 /sys/fs/cgroup/memory, or `mount`); `limit` None for
    none ("max", v1's huge value), `usage` (memory.current /
    memory.usage_in_bytes) and `inactive_file` (memory.stat: v2
    inactive_file; v1 total_inactive_file, beside a local inactive_file of 0
    that must not be read) left out where None."""
    top = mount or ("sys/fs/cgroup" if version == 2 else "sys/fs/cgroup/memory")
    d = os.path.join(top, cgroup.strip("/")) if cgroup.strip("/") else top
    if version == 2:
        files = {os.path.join(d, "memory.max"): "max\n" if limit is None else f"{limit}\n"}
        if usage is not None:
            files[os.path.join(d, "memory.current")] = f"{usage}\n"
        if inactive_file is not None:
            files[os.path.join(d, "memory.stat")] = (
                f"anon 1000\nfile 5000\nactive_file 0\ninactive_file {inactive_file}\nshmem 0\n")
    else:
        files = {os.path.join(d, "memory.limit_in_bytes"):
                 "9223372036854771712\n" if limit is None else f"{limit}\n"}
        if usage is not None:
            files[os.path.join(d, "memory.usage_in_bytes")] = f"{usage}\n"
        if inactive_file is not None:
            files[os.path.join(d, "memory.stat")] = (
                f"cache 0\nrss 0\nshmem 0\ninactive_file 0\nactive_file 0\n"
                f"total_cache {inactive_file}\ntotal_rss 0\ntotal_shmem 0\n"
                f"total_inactive_file {inactive_file}\ntotal_active_file 0\n")
    return files
