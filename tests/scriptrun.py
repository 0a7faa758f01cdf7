"""Running a script of scripts/ as its user would, less the interpreter's teardown.

A bench that imports torch and vLLM (or SGLang) spends 1.5-2.5 s after its
last line tearing those down, module by module, before its exit status comes
back: a wait that checks nothing. `run_script` runs the script as __main__
(argv, __file__ and sys.path[0] as `python SCRIPT ARGS` gives them), flushes
its output and leaves through os._exit with the status it exited with. An
exception it does not catch prints its traceback and exits 1, as Python would.
"""
import os
import subprocess
import sys

_BOOT = r"""
import os, runpy, sys, traceback
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(script))
try:
    runpy.run_path(script, run_name="__main__")
    code = 0
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    if not isinstance(exc.code, (int, type(None))):
        print(exc.code, file=sys.stderr)
except BaseException:
    traceback.print_exc()
    code = 1
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
"""


def run_script(script: str, *args: str, **kw) -> subprocess.CompletedProcess:
    """subprocess.run of `python SCRIPT ARGS...` (keywords as subprocess.run's)."""
    return subprocess.run([sys.executable, "-c", _BOOT, script, *args], **kw)
