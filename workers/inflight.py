"""Counting this engine's page writes in flight once in a capacity pass.

Owns the rule that tells, after a scan, whether a write the workers had in
flight is already in what the scan counted. Must not scan, remove or open
anything: it reads the control block and a finished scan's names and sizes.

A worker reserves a write's bytes (INFLIGHT, named by INFLIGHT_KEY) before
it makes the temp file, renames the temp file to the page name, then clears
INFLIGHT (workers.worker). A scan that adds INFLIGHT and every file it meets
counts such a write twice when it meets the temp file or the renamed page,
and the evictor then removes a page more than it must per write in flight.
The rule, per write seen in flight just before the scan (`before`):

  - its own temp file (this host's owner field, the worker's pid, the page's
    key in the name) is not counted: the write counts as its reservation,
    the whole file, not as the part written so far;
  - its reservation is counted, unless the write had ended by the end of the
    scan (`count_once`: INFLIGHT cleared, or the worker's key moved on to
    another write) AND the scan met a page file of that key. The page is
    then counted once, as a file.

Never an under-count: when the write has ended, the store holds that page
file (a write that failed left none: counting its reservation is over), and
whatever the scan met under that name is counted once; a write still going
at the end counts its reservation plus any page of that name met (an old
page it replaces: both are on disk until the rename). What is left counted
twice is safe: a write that renamed its file but had not yet cleared INFLIGHT
when the scan ended (microseconds), a write whose key changed while it was
read (counted as its bytes, its files as files), and one replacing a page
that already existed, after its rename.
"""
from typing import NamedTuple

import numpy as np

from workers import naming, tmpfiles
from workers.control import INFLIGHT, INFLIGHT_KEY, READY_PID, Control, write_key


class Write(NamedTuple):
    row: int          # the worker's row in the control block
    pid: int
    key: int | None   # None: the key changed while read; counted as its bytes only
    nbytes: int


def before(control: Control) -> list[Write]:
    """The writes in flight now, each paired with its key where that pairing is sure.

    The worker stores the key, then INFLIGHT; the key is read on both sides
    of INFLIGHT, so an equal pair names the write those bytes belong to.
    """
    w = control.workers
    key1 = w[:, INFLIGHT_KEY].copy()
    nbytes = w[:, INFLIGHT].copy()
    key2 = w[:, INFLIGHT_KEY].copy()
    pids = w[:, READY_PID].copy()
    return [Write(int(r), int(pids[r]), int(key1[r]) if key1[r] == key2[r] and pids[r] else None,
                  int(nbytes[r])) for r in np.flatnonzero(nbytes)]


def count_once(control: Control, scans: list, writes: list[Write]) -> tuple[list, list, int]:
    """After the scans, with each write of `writes` counted once (the module's
    rule): (bytes the scan met per part, less those writes' temp files;
    bytes reserved per part; bytes reserved in all). A write whose temp file
    was met is reserved on that part; one whose part is unknown is shared
    evenly (placement by digest fills the parts evenly)."""
    totals = [one.total_bytes for one in scans]
    known = {(w.pid, w.key): w for w in writes if w.key is not None}
    part_of = {}  # row -> part whose scan met that write's temp file
    if known:
        own = tmpfiles.owner()
        for i, one in enumerate(scans):
            for name, size in one.temps:
                writer = tmpfiles.parse(name)
                if writer is None or writer[1] != own:
                    continue
                digest = naming.digest_from_name(name[:name.find(naming.TMP_MARK)])
                w = None if digest is None else known.get((writer[0], write_key(digest)))
                if w is not None and w.row not in part_of:
                    part_of[w.row] = i
                    totals[i] -= size
    ended, met = _ended_and_met(control, scans, known)
    reserved, shared = [0] * len(scans), 0
    for w in writes:
        if w.row in ended and w.key in met:
            continue  # counted once: as the page the scan met
        if w.row in part_of:
            reserved[part_of[w.row]] += w.nbytes
        else:
            shared += w.nbytes
    reserved = [r + shared // len(scans) for r in reserved] if scans else reserved
    return totals, reserved, sum(w.nbytes for w in writes
                                 if not (w.row in ended and w.key in met))


def _ended_and_met(control: Control, scans: list, known: dict) -> tuple[set, set]:
    """(rows whose write seen before the scan has ended now, keys of those
    writes whose page the scan met)."""
    if not known:
        return set(), set()
    ws = control.workers
    nbytes_now = ws[:, INFLIGHT].copy()
    key_now = ws[:, INFLIGHT_KEY].copy()
    ended = {w.row: w.key for w in known.values()
             if nbytes_now[w.row] == 0 or int(key_now[w.row]) != w.key}
    met = set()
    if ended:
        keys = set(ended.values())
        for one in scans:
            for page in one.pages:
                key = write_key(page.digest)
                if key in keys:
                    met.add(key)
    return set(ended), met
