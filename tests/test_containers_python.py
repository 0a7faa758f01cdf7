"""Another uid runs this interpreter: the container tests' engines of uid 1000.

The container tests start engines as other uids (tests/containerkit.py,
`_user_python`) with the interpreter that runs the suite. On a root-owned
machine that interpreter often lies in root's home (pyenv's /root/.pyenv,
/root being 0700), and a newcomer's `python3 -m venv` puts bin/python3 there
as a symlink into it, with site-packages outside the base installation: the
kit bind-mounted only the base installation elsewhere, so in a venv uid
1000's engine died starting its workers (PermissionError on the venv's
python3). The kit now opens up, in the scenario's private mount namespace
only, each directory on the way that uid 1000 may not pass, with the same
paths; an interpreter it still cannot run is a skip that says why.

Here both layouts, whatever the suite runs in: a venv made in a 0700
directory (a home only root may enter) from this interpreter (itself in
root's home here), whose packages come through a .pth to this interpreter's
site-packages; its engine of uid 1000 starts a worker with it, writes and
reads a page. Root only; skipped, with the reason, where unshare is refused.
"""
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile

import pytest

import containerkit


def _venv(where: str, *extra) -> str:
    """A venv at `where` from this interpreter, with this interpreter's
    packages (a venv's own, or the base's) through a .pth: its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", *extra, where], check=True)
    python = os.path.join(where, "bin", "python3")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(purelib, "suite-packages.pth"), "w") as f:
        f.write("\n".join(site.getsitepackages() + [sysconfig.get_paths()["purelib"]]) + "\n")
    return python


def _user_store():
    parent = tempfile.mkdtemp(prefix="hicache-venv-store-")
    os.chmod(parent, 0o755)
    os.chown(parent, containerkit.USER, containerkit.USER)
    return parent, os.path.join(parent, "store")


def test_an_engine_of_another_uid_runs_from_a_venv_in_a_home_only_root_may_enter():
    containerkit.require_namespaces()
    home = tempfile.mkdtemp(prefix="hicache-home-")  # 0700, root's: as /root is
    parent, store = _user_store()
    try:
        assert os.stat(home).st_mode & 0o777 == 0o700
        python = _venv(os.path.join(home, "venv"))
        got = containerkit.in_private_shm("256m", "venv_user", {"python": python, "store": store})
    finally:
        shutil.rmtree(home)
        shutil.rmtree(parent)
    assert "cannot_run" not in got, got            # where this interpreter runs, so does its venv
    assert got["python"] == python, got            # the venv's, so its workers started with it
    assert got["wrote"] == "ok" and got["own_ok"] and got["workers"] == 1, got
    assert [n for n in got["left"] if n != "hicache_mp-node"] == [], got["left"]


def test_an_interpreter_the_uid_may_not_run_is_a_skip_that_says_why():
    containerkit.require_namespaces()
    parent = tempfile.mkdtemp(prefix="hicache-venv-")
    os.chmod(parent, 0o755)
    store_parent, store = _user_store()
    try:
        python = _venv(os.path.join(parent, "venv"), "--copies")
        os.chmod(python, 0o700)                    # root's alone, wherever it lies
        with pytest.raises(pytest.skip.Exception) as skipped:
            containerkit.in_private_shm("64m", "venv_user", {"python": python, "store": store,
                                                             "may_skip": True})
    finally:
        shutil.rmtree(parent)
        shutil.rmtree(store_parent)
    why = str(skipped.value)
    assert f"uid {containerkit.USER} cannot run {python}" in why and "ermission denied" in why, why
