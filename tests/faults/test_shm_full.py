"""A nearly full /dev/shm: a clear error at start, never a SIGBUS later.

Each case runs an engine in a child process with its own small tmpfs mounted
on /dev/shm (a private mount namespace: `unshare -m`, root only), so the
machine's /dev/shm is never filled. The child reports what happened; a child
killed by SIGBUS fails the test with that signal.
"""
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys

import pytest

from faultkit import HERE, TINY

PAGES = 32


def _pool_bytes() -> int:
    from shm import PageGeometry
    return PageGeometry(**TINY, layout="page_first").pool_bytes(PAGES)


def run_in_small_shm(shm_bytes: int, body: str, *args, tmpfs_store: str | None = None) -> dict:
    """Run `body` (fills `result`) in a child whose /dev/shm holds `shm_bytes`.
    `tmpfs_store`: a directory that gets a tmpfs of its own in the child's
    namespace too, so the pages written there go with it."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare(1) for a private /dev/shm")
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /dev/shm"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a private namespace: {probe.stderr.decode()[-200:]}")
    script = ("import json, sys\nsys.path[:0] = [%r]\nargs = json.loads(sys.argv[1])\n"
              "result = {}\n%s\nprint('RESULT ' + json.dumps(result), flush=True)\n") % (HERE, body)
    cmd = f"mount -t tmpfs -o size={shm_bytes} tmpfs /dev/shm && "
    if tmpfs_store:
        cmd += f"mount -t tmpfs -o size=64m tmpfs {shlex.quote(tmpfs_store)} && "
    cmd += "exec \"$0\" -c \"$1\" \"$2\""
    proc = subprocess.run(["unshare", "-m", "sh", "-c", cmd, sys.executable, script,
                           json.dumps(list(args))], capture_output=True, text=True, timeout=120)
    # sh execs python: a signal death shows as a negative return code, or 128+n from sh.
    assert proc.returncode not in (-signal.SIGBUS, 128 + signal.SIGBUS), \
        f"the engine's process died of SIGBUS:\n{proc.stderr[-2000:]}"
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"child failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")


def test_room_for_the_pool_only_is_refused_at_start(store):
    """The pool fits, the control block and rings do not: ValueError before any worker."""
    body = """
from faultkit import make
try:
    e = make(args[0], pages=args[1], workers=2)
except ValueError as exc:
    result["error"] = str(exc)
else:
    e.close()
    result["error"] = None
"""
    got = run_in_small_shm(_pool_bytes() + 64 * 1024, body, store, PAGES)
    assert got["error"] and "does not fit in /dev/shm" in got["error"], got


def test_dev_shm_filled_after_start_never_kills_the_engine(store):
    """Everything the engine maps was allocated at start: filling /dev/shm to the
    last byte afterwards costs nothing. Many distinct keys touch the whole pin
    table, every ring and the pool."""
    body = """
from faultkit import content, fill_dev_shm, get, make, put
e = make(args[0], pages=args[1], workers=2)
result["free_after_fill"] = fill_dev_shm("/dev/shm/filler")  # what is left, to ENOSPC
pb, n = e.geometry.page_bytes, args[1]
wrong = ok = 0
for round in range(40):
    keys = [f"k{round}-{i}" for i in range(n)]
    for i, k in enumerate(keys):
        put(e, i, content(k, pb))
    op = e.backup(keys, range(n))
    assert e.wait(op, 30)
    op = e.prefetch(keys, range(n))
    assert e.wait(op, 30)
    ok += op.ok_pages
    wrong += sum(get(e, i) != content(k, pb) for i, k in enumerate(keys))
e.close()
result.update(ok=ok, wrong=wrong, pages=40 * n)
"""
    # The store on a tmpfs of the child's namespace: its 1,280 page files,
    # removed from the disk at teardown while the session's background
    # harnesses sync theirs, took 2.7-5 s (0.3 s on a quiet disk)
    got = run_in_small_shm(_pool_bytes() + 8 * 2**20, body, store, PAGES, tmpfs_store=store)
    assert got["free_after_fill"] < 64 * 1024, got
    assert got["wrong"] == 0 and got["ok"] == got["pages"], got
