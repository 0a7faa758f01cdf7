"""What test_signal_wait runs as a child server (`python signal_wait_child.py MODE STORE`).

A real engine with one real worker on a real store: a page is backed up,
the worker is stopped (SIGSTOP: a stalled store or a descheduled worker), so a
prefetch of that page cannot finish, and the main thread waits on it; the
parent signals it there. One JSON line per event on stdout (READY, LANDED,
WAITED, KBI, AFTER, ESCAPED). Torch-free (faultkit): the child starts fast.

MODE
  exit    SIGTERM handler: sys.exit(3), as a server's that lets `with` close
          the engine. The wait must end with SystemExit: exit status 3.
  sigint  Python's own SIGINT handler: KeyboardInterrupt must reach the caller
          of wait(); the engine stays usable (the prefetch then completes) and
          closes; exit status 4.
  return  SIGTERM handler that only counts: the wait runs on to its own
          timeout (1.5 s), neither early nor restarted; then the prefetch
          completes with the right bytes; exit status 0.
"""
import json
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if __name__ == "__main__":
    sys.path[:0] = [ROOT, os.path.join(HERE, "faults")]

WAIT_S = 6.0          # exit and sigint: far longer than the parent allows for the stop
RETURN_WAIT_S = 1.5   # return: the wait's own timeout, which signals must not change


def _say(kind: str, **fields) -> None:
    os.write(1, (kind + " " + json.dumps(fields) + "\n").encode())  # never print(): reentrant


def _where(frame) -> str:
    """The innermost engine frame (file and function) at or above `frame`."""
    ours = [os.path.join(ROOT, d) + os.sep for d in ("hicache_mp", "shm", "workers")]
    while frame is not None:
        code = frame.f_code
        if any(code.co_filename.startswith(d) for d in ours):
            return f"{os.path.relpath(code.co_filename, ROOT)}:{code.co_name}"
        frame = frame.f_back
    return "outside"


def serve(mode: str, store: str) -> None:
    from faultkit import content, get, make, put

    from shm.names import list_ours, owner_pid

    hits = []

    def on_term(signum, frame):
        hits.append(_where(frame))
        _say("LANDED", where=hits[-1])
        if mode == "exit":
            sys.exit(3)

    if mode in ("exit", "return"):
        signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as if started from a shell

    with make(store, pages=8, workers=1) as e:
        nbytes = e.geometry.page_bytes
        put(e, 0, content("k", nbytes))
        op = e.backup(["k"], [0])
        assert e.wait(op, 30) and op.status == "ok", op
        worker = e.worker_pids()[0]
        os.kill(worker, signal.SIGSTOP)
        try:
            pre = e.prefetch(["k"], [1])
            segments = [n for n in list_ours() if owner_pid(n) == os.getpid()]
            _say("READY", workers=e.worker_pids(), segments=segments)
            t0 = time.monotonic()
            if mode == "return":
                done = e.wait(pre, RETURN_WAIT_S)
                _say("WAITED", done=done, seconds=round(time.monotonic() - t0, 3), hits=hits)
            else:
                try:
                    done = e.wait(pre, WAIT_S)
                except KeyboardInterrupt as exc:
                    tb = exc.__traceback__
                    while tb.tb_next is not None:
                        tb = tb.tb_next
                    _say("KBI", seconds=round(time.monotonic() - t0, 3), where=_where(tb.tb_frame))
                else:  # the signal's exception was lost: the wait ran to its timeout
                    _say("WAITED", done=done, seconds=round(time.monotonic() - t0, 3), hits=hits)
                    return
        finally:
            os.kill(worker, signal.SIGCONT)
        # the engine is as consistent as before the signal: the prefetch completes
        done = e.wait(pre, 30)
        _say("AFTER", done=done, status=pre.status, right=get(e, 1) == content("k", nbytes))
    if mode == "sigint":
        sys.exit(4)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
