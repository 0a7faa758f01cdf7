"""close() in a SIGTERM handler, the way a server stops (issue 23, bug 1).

A child server (sigterm_kit: a real engine, real workers, a real store) runs
a loop that fills host slots, backs up, prefetches, polls and waits; this
process sends it SIGTERM at random points, aimed at a phase: inside wait(),
inside poll(), inside backup(), between calls. Its handler closes the engine
and exits (os._exit, raise SystemExit, sys.exit), or only closes, and then
the loop must see EngineClosed from every engine call and host-pool access.

What a user would notice: the server stops within a second plus the flush
close() reported (asserted with a second of margin for a loaded machine;
tests/faults/sigterm_trials.py counts the strict bound over 200 SIGTERMs); no
exception but EngineClosed escapes an engine call; every backup page the
server saw acknowledged (or the handler's flush reported written) is on disk
byte for byte; no segment and no worker is left.
"""
import pytest

from sigterm_kit import TARGETS, trial

MARGIN_S = 1.0
LANDS_IN = {"wait": "wait", "poll": "poll", "backup": "backup", "between": "outside"}


def _check(results) -> None:
    assert results
    for r in results:
        where = f"{r['handler']} handler, aimed at {r['target']}, landed {r.get('landed')}"
        assert not r["escaped"], f"{where}: {r['escaped']}"
        assert r["stop_s"] is not None and r["stop_s"] <= 1.0 + r["flush_s"] + MARGIN_S, \
            f"{where}: stopped after {r['stop_s']}s (flush {r['flush_s']}s: {r['report']})"
        assert r["lost"] == 0, f"{where}: {r['lost']} acknowledged page(s) not on disk"
        assert r.get("round", {}).get("wrong", 0) == 0, f"{where}: wrong bytes read back"
        assert not r["shm_left"] and not r["procs_left"], \
            f"{where}: left {r['shm_left']} in /dev/shm, processes {r['procs_left']}"


# `raise SystemExit` and `sys.exit()` are one path (sys.exit raises SystemExit):
# one run takes both, each spelling on half the targets (a child server each).
@pytest.mark.parametrize("handlers", [("os_exit",), ("raise", "sys_exit")],
                         ids=["os_exit", "system_exit"])
def test_a_handler_that_closes_and_exits(tmp_path, handlers):
    _check([r for i, target in enumerate(TARGETS)
            for r in trial(str(tmp_path), handlers[i % len(handlers)], target, seed=i)])


@pytest.mark.parametrize("target", TARGETS)
def test_a_handler_that_only_closes(tmp_path, target):
    results = trial(str(tmp_path), "close", target, rounds=5, seed=7)
    _check(results)
    landed = [r["landed"]["api"] for r in results]
    assert LANDS_IN[target] in landed, f"no SIGTERM of five aimed at {target} landed there: {landed}"
    assert all(r["round"]["closed_in"] for r in results)
