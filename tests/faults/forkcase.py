"""One fork case of test_fork, run as its own process (argv: store, case).

The parent makes an engine and writes two sets of pages; a child forked from
it (os.fork, or a multiprocessing "fork" Process) does what `case` says and
exits the normal way (sys.exit: atexit and finalisers run). The parent then
keeps using its engine and prints what it saw as one JSON line.

Cases: exit (the child never touches the engine), close (the child calls
close()), prefetch (the child prefetches into the parent's slots and waits),
mp (a multiprocessing fork child prefetches).
"""
import json
import multiprocessing
import os
import sys

from faultkit import backup, content, fingerprint, make, prefetch, wrong_pages

from hicache_mp import EngineForked

store, case = sys.argv[1], sys.argv[2]
e = make(store, pages=16, workers=2)
mine = [f"parent{i}" for i in range(8)]
theirs = [f"child{i}" for i in range(8)]
backup(e, mine, range(8))
backup(e, theirs, range(8, 16))
pids = e.worker_pids()


def child_body() -> str:
    try:
        if case == "close":
            e.close()
        elif case in ("prefetch", "mp"):
            op = e.prefetch(theirs, range(8))
            e.wait(op, 5)
        else:
            return "untouched"
        return "used the parent's engine"
    except EngineForked:
        return "refused"


if case == "mp":
    ctx = multiprocessing.get_context("fork")
    said = ctx.Queue()
    child = ctx.Process(target=lambda: said.put(child_body()))
    child.start()
    child_said = said.get(timeout=30)
    child.join(30)
    child_exit = child.exitcode
else:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.write(w, child_body().encode())
        os.close(w)
        sys.exit(0)
    os.close(w)
    child_said = os.read(r, 200).decode()
    os.close(r)
    child_exit = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

want = lambda key: {fingerprint(content(key, e.geometry.page_bytes))}  # noqa: E731
statuses, wrong, error = [], 0, None
try:
    for _ in range(3):
        op = prefetch(e, mine, range(8), timeout_s=10)
        statuses.append(op.status)
        wrong += len(wrong_pages(e, op, want))
except BaseException as exc:  # what a broken parent engine raises is the finding
    error = repr(exc)
alive = all(os.path.exists(f"/proc/{p}") for p in pids) and e.worker_pids() == pids
print(json.dumps({"child": child_said, "child_exit": child_exit, "statuses": statuses,
                  "wrong": wrong, "error": error, "workers_kept": alive,
                  "ops_in_flight": e.metrics()["ops_in_flight"] if error is None else None}))
e.close()
