"""SIGTERM trials: a server process whose handler closes the engine, and the parent that stops it.

The child (`python sigterm_kit.py child ARGS`) is what a server does: a real
engine with real workers on a real store, a loop that fills host slots,
backs up, prefetches what it backed up, polls and waits, and a SIGTERM
handler that calls `engine.close()` and then exits (`os_exit`: os._exit,
`raise`: raise SystemExit, `sys_exit`: sys.exit) or only returns (`close`:
the loop must then see EngineClosed and nothing else, and runs its next
round on a new engine). It marks the phase it is in (one byte of a shared
file), appends every backup page it saw acknowledged to an ack file (also
those the handler's flush reported written), and reports on stdout, one JSON
line each: READY, TERM (from the handler: where the signal landed, close()'s
time and report), ROUND (the loop saw the close), ESCAPED (an engine call
raised something other than EngineClosed).

The parent (`trial`) waits a random time, spins until the child is in the
phase it aims at, sends SIGTERM, and checks what a user would notice: how long
the server took to stop, what escaped, that every acknowledged page is on disk
byte for byte, and that no segment or process is left. Torch-free (faultkit).
"""
import json
import mmap
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if __name__ == "__main__":
    sys.path[:0] = [ROOT, HERE]

PHASES = {"none": 0, "fill": 1, "backup": 2, "prefetch": 3, "poll": 4, "wait": 5, "exists": 6,
          "between": 7}
HANDLERS = ("os_exit", "raise", "sys_exit", "close")
TARGETS = ("wait", "poll", "backup", "between")
OPS, POOL = 32, 96               # pages per backup; host pool pages (two backup halves, prefetches)
GEO = dict(num_layers=4, num_kv_heads=4, head_dim=64, page_size=16)  # 64 KiB pages


# --- the child: a server ------------------------------------------------------------
def _say(kind: str, **fields) -> None:
    os.write(1, (kind + " " + json.dumps(fields) + "\n").encode())  # never print(): reentrant


def _landed(frame) -> dict:
    """Where the signal interrupted the main thread: the outermost and the
    innermost engine function on its stack (outside: in none)."""
    ours = [os.path.join(ROOT, d) + os.sep for d in ("hicache_mp", "shm", "workers")]
    names = []
    while frame is not None:
        if any(frame.f_code.co_filename.startswith(d) for d in ours):
            names.append(frame.f_code.co_name)
        frame = frame.f_back
    return {"api": names[-1] if names else "outside", "inner": names[0] if names else "outside"}


class _Closed(Exception):
    pass


def serve(store: str, handler: str, rounds: int, workers: int, phase_path: str,
          ack_path: str) -> None:
    from faultkit import content, get, make, put

    from hicache_mp import EngineClosed
    from workers import status as st

    fd = os.open(phase_path, os.O_RDWR)
    phase = mmap.mmap(fd, 4096)
    os.close(fd)
    acks = os.open(ack_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    held = {"engine": None, "writes": []}

    def ack(ops) -> list:
        keys = [k for op in ops for k, s in zip(op.keys, op.page_status.tolist()) if s == st.OK]
        if keys:
            os.write(acks, ("\n".join(keys) + "\n").encode())
        return keys

    def on_term(signum, frame):
        where = _landed(frame)
        where["phase"] = phase[0]
        t0 = time.monotonic()
        error = None
        try:
            held["engine"].close()
        except BaseException as exc:
            error = "".join(traceback.format_exception(exc))
        close_s = time.monotonic() - t0
        report = None
        try:
            report = held["engine"].metrics()["close"]
        except BaseException as exc:
            error = (error or "") + "metrics() after close(): " + repr(exc)
        acked = ack(held["writes"])  # what the flush reported written counts too
        held["writes"] = []
        _say("TERM", landed=where, close_s=round(close_s, 4), report=report, error=error,
             acked_by_flush=len(acked))
        if handler == "os_exit":
            os._exit(0)
        if handler == "raise":
            raise SystemExit(0)
        if handler == "sys_exit":
            sys.exit(0)

    def call(name, fn, *args):
        phase[0] = PHASES[name]
        try:
            return fn(*args)
        except EngineClosed:
            raise _Closed(name)
        except Exception as exc:
            _say("ESCAPED", call=name, error="".join(traceback.format_exception(exc)))
            os._exit(3)
        finally:
            phase[0] = 0

    signal.signal(signal.SIGTERM, on_term)
    for rnd in range(rounds):
        e = make(store, geo=GEO, pages=POOL, workers=workers)
        held["engine"], held["writes"] = e, []
        nbytes, acked, wrong, it = e.geometry.page_bytes, [], 0, 0
        _say("READY", round=rnd, namespace=e.namespace, workers=e.worker_pids())
        op = pre = None
        try:
            while True:
                keys = [f"r{rnd}-{it}-{i}" for i in range(OPS)]
                slots = list(range(OPS * (it % 2), OPS * (it % 2) + OPS))
                datas = [content(k, nbytes) for k in keys]
                for s, data in zip(slots, datas):
                    call("fill", put, e, s, data)
                op = call("backup", e.backup, keys, slots)
                held["writes"] = [op]
                pre = None
                if acked:
                    got = random.sample(acked, min(16, len(acked)))
                    pre = call("prefetch", e.prefetch, got, list(range(2 * OPS, 2 * OPS + len(got))))
                if it % 2 == 0:
                    phase[0] = PHASES["poll"]
                    while not (op.done and (pre is None or pre.done)):
                        call("poll", e.poll)
                else:
                    if not call("wait", e.wait, op, 30) or \
                            (pre is not None and not call("wait", e.wait, pre, 30)):
                        _say("ESCAPED", call="wait", error="a wait of 30 s timed out")
                        os._exit(3)
                acked += ack([op])
                held["writes"] = []
                if pre is not None:
                    for pos in [i for i, s in enumerate(pre.page_status.tolist()) if s == st.OK]:
                        slot = int(pre.host_pages[pos])
                        if call("fill", get, e, slot) != content(pre.keys[pos], nbytes):
                            wrong += 1
                if it % 3 == 0:
                    call("exists", e.exists, keys)
                phase[0] = PHASES["between"]
                spin = time.perf_counter() + random.uniform(0.0005, 0.003)  # the server's own work
                while time.perf_counter() < spin:
                    pass
                phase[0] = 0
                it += 1
        except _Closed as closed:
            first = str(closed)
        after = _after_close(e, op, pre, put, nbytes)
        acked_after = ack(held["writes"])
        held["writes"] = []
        _say("ROUND", round=rnd, closed_in=first, iterations=it, acked=len(acked),
             acked_after=len(acked_after), wrong=wrong, after=after)
    os._exit(0)


def _after_close(e, op, pre, put, nbytes) -> list:
    """Every later call ends with EngineClosed (cancel: nothing to do); what did not."""
    from hicache_mp import EngineClosed
    bad = []
    calls = {"wait": lambda: e.wait(op, 1), "poll": e.poll,
             "prefetch": lambda: e.prefetch(["later"], [2 * OPS]),
             "backup": lambda: e.backup(["later"], [0]), "exists": lambda: e.exists(["later"]),
             "ask": lambda: e.ask(["later"]), "put": lambda: put(e, 0, bytes(nbytes)),
             "page_view": lambda: e.host_pool.page_view(0),
             "segment": lambda: e.host_pool.segment}
    for name, fn in calls.items():
        try:
            fn()
            bad.append(f"{name}: returned")
        except EngineClosed:
            pass
        except Exception as exc:
            bad.append(f"{name}: {exc!r}")
    for name, fn in {"cancel": lambda: [e.cancel(o) for o in (op, pre) if o is not None],
                     "metrics": e.metrics, "close": e.close}.items():
        try:
            fn()
        except Exception as exc:
            bad.append(f"{name}: {exc!r}")
    if op is not None and not op.done:
        bad.append(f"an op still running after close(): {op}")
    return bad


# --- the parent ---------------------------------------------------------------------
def _reader(pipe, out: queue.Queue) -> None:
    for line in pipe:
        kind, _, rest = line.partition(" ")
        try:
            out.put((time.monotonic(), kind, json.loads(rest)))
        except ValueError:
            out.put((time.monotonic(), "NOISE", {"line": line}))
    out.put((time.monotonic(), "EOF", {}))


def _until(lines: queue.Queue, kinds, timeout_s: float, seen: list):
    """Lines into `seen` until one of `kinds`: (its time, kind, body), or Nones."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            t, kind, body = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None, None, None
        seen.append((kind, body))
        if kind in kinds:
            return t, kind, body


def trial(root: str, handler: str, target: str, *, rounds: int = 1, workers: int = 2,
          seed: int | None = None) -> list[dict]:
    """One child server and `rounds` SIGTERMs to it (only the `close` handler
    lives past one); a result per SIGTERM. The child's store goes afterwards."""
    import shutil
    rounds = rounds if handler == "close" else 1
    rng = random.Random(seed)
    base = os.path.join(root, f"t{os.getpid()}-{time.monotonic_ns()}")
    store, phase_path, ack_path = base + "-store", base + "-phase", base + "-acks"
    os.makedirs(store)
    with open(phase_path, "wb") as f:
        f.write(bytes(4096))
    fd = os.open(phase_path, os.O_RDWR)
    phase = mmap.mmap(fd, 4096)
    os.close(fd)
    args = [store, handler, rounds, workers, phase_path, ack_path]
    stderr = open(base + "-stderr", "w+")
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "child", json.dumps(args)],
                            stdout=subprocess.PIPE, stderr=stderr, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
    results, namespace, workers_seen = [], None, []
    try:
        for _ in range(rounds):
            seen: list = []
            res = {"handler": handler, "target": target, "escaped": [], "stop_s": None,
                   "seen": seen}
            results.append(res)
            _, kind, ready = _until(lines, ("READY", "EOF"), 120, seen)
            if kind != "READY":
                res["escaped"].append("the child never said READY")
                break
            namespace = ready["namespace"]
            workers_seen += ready["workers"]
            time.sleep(rng.uniform(0.02, 0.15))
            want, spin_end = PHASES[target], time.monotonic() + 1.0
            while phase[0] != want and time.monotonic() < spin_end:
                pass
            t_kill = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            if handler == "close":
                t_end, kind, _ = _until(lines, ("ROUND", "EOF"), 60, seen)
                if kind == "EOF":
                    t_end = None
            else:
                try:
                    proc.wait(60)
                    t_end = time.monotonic()
                except subprocess.TimeoutExpired:
                    t_end = None
            if t_end is None:
                res["escaped"].append("the server did not stop (60 s)")
                break
            res["stop_s"] = round(t_end - t_kill, 4)
        proc.wait(60)
        _until(lines, ("EOF",), 10, results[-1]["seen"])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        phase.close()
    stderr.seek(0)
    text = stderr.read()
    stderr.close()
    lost = _check_acks(store, namespace, ack_path)
    from helpers import leftovers  # the parent's side only: the child never needs it
    shm_left, procs_left = leftovers(proc.pid, workers_seen)
    for res in results:  # what is checked once per child counts on its last round
        _collect(res, res.pop("seen"))
        res.update(lost=0, shm_left=[], procs_left=[], rc=proc.returncode)
    results[-1].update(lost=lost, shm_left=shm_left, procs_left=procs_left)
    if proc.returncode != 0:
        results[-1]["escaped"].append(f"exit code {proc.returncode}")
    if "Traceback" in text:
        results[-1]["escaped"].append("stderr: " + text[-1500:])
    shutil.rmtree(store, ignore_errors=True)
    for p in (phase_path, ack_path, base + "-stderr"):
        if os.path.exists(p):
            os.unlink(p)
    return results


def _collect(res: dict, seen: list) -> None:
    """A round's TERM, ROUND and ESCAPED lines, into its result."""
    for kind, body in seen:
        if kind == "TERM":
            res["landed"] = body["landed"]
            res["close_s"] = body["close_s"]
            res["report"] = body["report"] or {}
            res["flush_s"] = res["report"].get("flush_s", 0.0)
            if body["error"]:
                res["escaped"].append("close() in the handler: " + body["error"][-1500:])
        elif kind == "ROUND":
            res["round"] = {k: body[k] for k in ("closed_in", "iterations", "acked",
                                                 "acked_after", "wrong")}
            res["escaped"] += body["after"]
        elif kind == "ESCAPED":
            res["escaped"].append(f"{body['call']}: {body['error'][-1500:]}")
        elif kind == "NOISE":
            res["escaped"].append("stdout: " + body["line"][-300:])
    if "landed" not in res:
        res["escaped"].append("the handler never reported")


def _check_acks(store: str, namespace, ack_path: str) -> int:
    """Acknowledged pages not on disk byte for byte (checked as a reader would:
    header, geometry, key, then every payload byte)."""
    from faultkit import content
    from shm import PageGeometry
    from workers import naming, pagefile
    from workers import status as st
    from workers.stores import open_store
    if namespace is None or not os.path.exists(ack_path):
        return 0
    ns = namespace
    g = PageGeometry(**GEO, layout="page_first")
    fs, fp = open_store(store), g.fingerprint()
    with open(ack_path) as f:
        keys = [k for k in f.read().split("\n") if k]
    lost = 0
    for key in set(keys):
        digest = naming.key_digest(key, ns)
        try:
            with open(fs.path(digest), "rb") as f:
                data = f.read()
        except OSError:
            lost += 1
            continue
        header, payload = data[:pagefile.HEADER_SIZE], data[pagefile.HEADER_SIZE:]
        if pagefile.check_header(header, g.page_bytes, fp, digest)[0] != st.OK or \
                payload != content(key, g.page_bytes):
            lost += 1
    return lost


if __name__ == "__main__" and sys.argv[1] == "child":
    serve(*json.loads(sys.argv[2]))
