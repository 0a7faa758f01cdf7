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
