"""An engine belongs to the process that made it (issue 17, item 1).

A forked child, whatever it does, cannot use the parent's engine (every call
raises EngineForked) and nothing it does, nor its exit, touches the parent's
workers, rings or segments: the parent goes on with the right bytes.
"""
import json
import os
import subprocess
import sys

import pytest

from hicache_mp import EngineClosed, EngineForked

from faultkit import HERE, make

ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.mark.parametrize("case, child", [("exit", "untouched"), ("close", "refused"),
                                         ("prefetch", "refused"), ("mp", "refused")])
def test_a_forked_child_never_touches_the_parents_engine(store, case, child):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, ROOT]))
    out = subprocess.run([sys.executable, os.path.join(HERE, "forkcase.py"), store, case],
                         capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"child": child, "child_exit": 0, "statuses": ["ok"] * 3, "wrong": 0,
                   "error": None, "workers_kept": True, "ops_in_flight": 0}, out.stderr[-3000:]


def test_every_call_in_a_child_raises_a_clear_error(store):
    with make(store, pages=4, workers=1) as e:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # only os._exit leaves this branch: never back into pytest
            try:
                os.close(r)
                said = []
                calls = [lambda: e.exists(["a"]), lambda: e.present(["a"]),
                         lambda: e.prefetch(["a"], [0]), lambda: e.backup(["a"], [0]),
                         e.poll, e.metrics, e.refresh, e.close, lambda: e.mark_present(["a"]),
                         e.forget_all]
                for call in calls:
                    try:
                        call()
                        said.append("ran")
                    except EngineForked as exc:
                        said.append("forked" if str(os.getpid()) in str(exc) and
                                    isinstance(exc, EngineClosed) else "unclear")
                os.write(w, json.dumps(said).encode())
            finally:
                os._exit(0)
        os.close(w)
        said = json.loads(os.read(r, 4096).decode())
        os.close(r)
        os.waitpid(pid, 0)
        assert said == ["forked"] * 10
        op = e.prefetch(["a"], [0])  # the parent's own engine is untouched
        assert e.wait(op, 10) and op.status == "failed"  # a miss: "a" was never written
