"""Faults a server meets on a shared cluster (issue 23's fault suite), the
parts that need no shared filesystem (JuiceFS client death is
tests/scaleout/test_client_death.py):

- the whole server (the engine's process and its workers: one process group)
  paused with SIGSTOP for longer than stall_timeout_s, then continued, as a
  node that is frozen (a VM paused or migrated, the cgroup frozen) does: no
  worker is taken for stuck and killed, every op ends, every page reported
  ok holds its bytes and every acknowledged backup reads back whole;
- SGLang's own HiCacheStorageFailureInjector wrapped around the adapter,
  dense and hybrid, and a hybrid model's sidecar file damaged on disk (a
  miss, never a wrong Mamba state): tests/faults/test_sglang_faults.py;
- a worker stopped with reads queued: tests/faults/test_stopped_worker.py.
"""
import json
import os
import signal
import subprocess
import sys
import time

from workers.control import Control

from faultkit import HERE

STALL_S = 1.0
PAUSE_S = 1.5     # over stall_timeout_s, by a margin the engine's clock sees
PAUSES = 1
RESUME_GAP_S = 0.2  # the workers go on this much after the engine (under STALL_S)


def _group_state(pgid: int) -> set:
    states = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            states.add(fields[0])
    return states


def test_the_whole_server_paused_past_the_stall_timeout_loses_nothing(tmp_path):
    store, stop = tmp_path / "store", tmp_path / "stop"
    store.mkdir()
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(HERE))
    env["PYTHONPATH"] = os.pathsep.join([root, HERE, env.get("PYTHONPATH", "")])
    server = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "pauseserver.py"), str(store), str(stop), str(STALL_S)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)  # its own process group, which its workers join
    control = None
    try:
        ready = server.stdout.readline().split()
        assert ready and ready[0] == "READY", server.stderr.read()[-3000:]
        control = Control(ready[1], create=False)
        beats = control.heartbeat[:2]
        pgid = os.getpgid(server.pid)
        assert len([p for p in os.listdir("/proc") if p.isdigit()
                    and _pgid(int(p)) == pgid]) >= 3  # the server and its two workers
        for _ in range(PAUSES):
            time.sleep(0.2)
            _stop_inside_an_io(pgid, beats)
            time.sleep(PAUSE_S)
            # The order the kernel runs them again in is anyone's; the worst is
            # the engine first: its watchdog then sees I/O as old as the pause.
            os.kill(server.pid, signal.SIGCONT)
            time.sleep(RESUME_GAP_S)
            os.killpg(pgid, signal.SIGCONT)
        time.sleep(0.3)
        stop.touch()
        out, err = server.communicate(timeout=120)
    finally:
        if control is not None:
            control.close()
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGCONT)
            server.kill()
            server.wait()
    assert server.returncode == 0, err[-3000:]
    result = json.loads([ln for ln in out.splitlines() if ln.startswith("RESULT ")][0][7:])
    assert result["wrong"] == 0 and result["hung"] == 0 and result["lost"] == 0, result
    assert result["stuck_workers"] == 0 and result["stalled_pages"] == 0, result
    assert set(result["statuses"]) == {"ok"}, result
    assert result["acked"] >= 16, result


def _stop_inside_an_io(pgid: int, beats) -> None:
    """SIGSTOP the group at a moment a worker is inside a page I/O (its
    heartbeat set), so that I/O is as old as the pause when it goes on."""
    for _ in range(200):
        deadline = time.monotonic() + 2
        while not beats.any() and time.monotonic() < deadline:
            pass  # spin: a page I/O lasts about a millisecond
        os.killpg(pgid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while _group_state(pgid) - {"T", "t"}:
            assert time.monotonic() < deadline, _group_state(pgid)
            time.sleep(0.001)
        if beats.any():
            return
        os.killpg(pgid, signal.SIGCONT)
    raise AssertionError("never stopped the server with a worker inside a page I/O")


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None
