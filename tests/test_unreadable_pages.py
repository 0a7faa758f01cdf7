"""A page file that cannot be read is forgotten until it is written again (issue 33, finding 4).

A read that fails with EACCES or EIO (status `unreadable`) leaves the file
there by name and size: the next `exists()` probe would find it again, the
prefix would be claimed restorable on every call and SGLang's next backup
skipped as stored (the adapter writes only what `present()` says is
missing). As decision 81 does for damaged files, the index distrusts it.

Both faults are real, in a child interpreter (faultkit.run_child):
- EACCES: a mode-000 page file read by an engine without CAP_DAC_OVERRIDE
  (root ignores file modes; setuid cannot start workers here, see run_child);
- EIO: a FUSE directory mounted over the page's fan-out leaf in a private
  mount namespace, whose reads fail with EIO (tests/faults/eiofuse.py: this
  machine has no device-mapper driver for an `error` target).
"""
import os

import pytest

from faultkit import run_child
from workers import status as st

BODY = """
import os
from faultkit import backup, content, fingerprint, get, make, page_file, prefetch
import eiofuse
fault = args[1]
keys = ["a", "b", "c", "d"]
if fault == "eio":
    eiofuse.private_mounts()     # before the workers start: they share the mount
with make(args[0], pages=8, workers=1) as e:
    pb = e.geometry.page_bytes
    backup(e, keys, range(4))
    path = page_file(e, "d")
    before = os.stat(path)
    if fault == "eacces":
        os.chmod(path, 0)
    else:
        leaf = os.path.dirname(path)
        assert os.listdir(leaf) == [os.path.basename(path)]
        fuse = eiofuse.mount_eio(leaf, {os.path.basename(path): before.st_size})
    op = prefetch(e, keys, range(4, 8))
    result["get"] = [st for st in op.status_counts()]
    result["statuses"] = [int(s) for s in op.page_status]
    result["errno"] = e.metrics().get("read_errno")
    # the store is asked again: the file is still there by name and size
    result["exists"] = e.exists(keys, wait_s=2.0)
    result["present"] = e.present(keys).tolist()
    result["exists_again"] = e.exists(keys, wait_s=2.0)
    if fault == "eio":
        result["fuse_reads"] = fuse.reads
        fuse.unmount()           # the old, readable file is back under the name
        result["exists_unmounted"] = e.exists(keys, wait_s=2.0)
    # what SGLang's adapter writes: the pages present() says are missing
    todo = [k for k, p in zip(keys, e.present(keys).tolist()) if not p]
    result["todo"] = todo
    w = backup(e, todo, [0], version=1) if todo else None
    result["set"] = None if w is None else [int(s) for s in w.page_status]
    after = os.stat(path)
    result["rewritten"] = after.st_ino != before.st_ino
    result["mode"] = after.st_mode & 0o777
    r = prefetch(e, ["d"], [7])
    result["reget"] = [int(s) for s in r.page_status]
    result["bytes_right"] = fingerprint(get(e, 7)) == fingerprint(content("d", pb, version=1))
    result["others_right"] = all(fingerprint(get(e, 4 + i)) == fingerprint(content(k, pb))
                                 for i, k in enumerate(keys[:3]))
"""


@pytest.mark.parametrize("fault", ["eacces", "eio"])
def test_unreadable_page_is_forgotten_and_written_again(tmp_path, fault):
    if fault == "eio" and not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse for a real EIO")
    got = run_child(BODY, str(tmp_path), fault, unprivileged=fault == "eacces")
    assert got["statuses"] == [st.OK, st.OK, st.OK, st.UNREADABLE], got
    assert got["others_right"]
    if fault == "eio":
        assert got["fuse_reads"] >= 1, got      # the read reached the failing device
    # not found again as present, by the index or by asking the store
    assert got["exists"] == 3 and got["exists_again"] == 3, got
    assert got["present"] == [True, True, True, False], got
    if fault == "eio":
        assert got["exists_unmounted"] == 3, got  # a file readable again: still not believed
    # the next backup writes it: a new file, readable, the new bytes
    assert got["todo"] == ["d"] and got["set"] == [st.OK], got
    assert got["rewritten"] and got["mode"] == 0o600, got
    assert got["reget"] == [st.OK] and got["bytes_right"], got
