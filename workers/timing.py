"""Every fixed interval of the engine, its workers and its store, and how they relate.

Owns the numbers only. Must not import anything: it is the lowest module
both `hicache_mp` and `workers` import. What an operator may tune is an
`EngineConfig` setting instead (stall_timeout_s, eviction_interval_s,
worker_start_timeout_s, io_timeout_s, ...); these are the intervals those
settings are built on. Modules import the names they use, so each name
stays readable (and patchable) where it is used.

The scheduler's side, shortest first. A waiter sleeps on a semaphore that a
worker posts; each expiry costs the waiter the GIL back once, so the sleeps
are as long as correctness allows and the caps are only for what no post
announces:

    AHEAD_MIN_S        1 ms   a GIL hand-back slower than this (the waiters' EWMA
                              of post -> running again) is worth waking ahead
                              of a batch's end for (waiters note 9); idle, it
                              takes microseconds and a waiter wakes at the end
    AHEAD_SHARE        0.75   ... and wakes ahead by this share of that delay: a
                              little less than all of it, so the batch is
                              mostly done when the GIL comes back and a spin
                              (below) is the exception
    SPIN_CAP_S         1 ms   woken ahead with the GIL back, a waiter drains
                              (GIL held) at most this long for the batch's last
                              pages before it sleeps again: well under the
                              switch interval a second sleep would cost
    NO_TARGET_CAP_S    5 ms   a waiter on no op (a post after every completion)
    DEVICE_WAIT_SLICE_S 2 ms  a device load waits on its engine in slices this
                              short, so it copies pages to the GPU as they land
    PROBE_WAIT_SLICE_S 50 ms  exists(wait_s): between looks at the probe answers
    HEALTH_CHECK_S     0.1 s  poll() looks at the workers' health at most this often
    TARGET_CAP_S       0.2 s  a waiter on an op: a post ends it when its pages are
                              done; the cap covers a worker that dies mid-batch
    WAIT_SLICE_S       0.2 s  wait()'s longest sleep before it polls again, so a
                              dead worker or a closed engine is seen within
                              WAIT_SLICE_S + HEALTH_CHECK_S
    PROBE_TTL_S        0.25 s a key probed is not probed again this soon: a
                              scheduler asking in a loop costs one stat per key
                              per PROBE_TTL_S
    SCAN_PROBE_WAIT_S  0.5 s  until the store scan at start is whole, exists()
                              waits at least this long for the workers' answers
                              about keys the index does not know yet (a stat
                              each: a millisecond on local disk), so a page the
                              scan has not reached is not answered as a miss
    ABANDON_GRACE_S    1 s    abandon(): time for workers to skip a cancelled
                              op's pages before its slots are taken back (the
                              SGLang adapter: at most its io_timeout_s)
    ANSWER_LOST_S      2 s    a probe unanswered this long went with a dead
                              worker: not waited for (PROBE_TTL_S lets it be
                              asked again long before)

close() (hicache_mp.engine.closing), on the same clock:

    FLUSH_POLL_S       2 ms   the polling flush (a close inside an engine call
                              of its own thread) sleeps this long between polls
    FLUSH_IDLE_S       0.1 s  that flush ends after this long of no progress
                              while no record waits and no worker is in a page I/O
    FLUSH_QUIET_S      0.6 s  ... and after this long of no backup page done in
                              any case: longer than WRITE_DEFER_MAX_S, so a
                              backup deferred behind reads is still waited for
    SLOW_CLOSE_S       1 s    a close() slower than this logs why
    SLEEPERS_GONE_S    5 s    close() waits this long for other threads' sleepers
                              to leave their semaphore before it is closed (each
                              sleeps TARGET_CAP_S at most, so this is a backstop)

The worker's side (the same clock, in each worker process):

    BACKOFF_S          0.5 ms the shortest sleep, while another party must act
                              first: a full completion ring (the scheduler drains
                              it), a device load whose engine another thread polls
    DEFER_POLL_S       2 ms   a worker with a deferred write looks again (no one
                              posts it when another worker's reads finish)
    CHILD_READY_POLL_S 2 ms   the parent looks for its children's ready words
    SCAN_PUSH_POLL_S   2 ms   the store scanner, its ring full, looks again for
                              room (the engine takes a share of it per poll)
    PARENT_CHECK_S     0.25 s an idle child looks at its parent: also the longest
                              an orphan lives once its parent has exited
    PARENT_EXIT_S      5 s    reparented, an orphan waits at most this long for
                              its parent's last thread to exit (and with it the
                              flock of the owner's lock file): the kernel may
                              still be tearing down the parent's address space
                              (about 0.2 s per GiB touched, here), a backstop
    STILL_S            0.25 s a worker with reads queued that neither runs a page
                              I/O nor finishes a read this long no longer holds
                              back other workers' writes: far above the gap
                              between a healthy worker's two page I/Os, below
                              WRITE_DEFER_MAX_S (which lets the write go anyway)
    WRITE_DEFER_MAX_S  0.5 s  a write deferred for reads elsewhere goes anyway:
                              the backstop against starving backups
    SLOW_IO_S          0.5 s  a page I/O older than this no longer holds back
                              other workers' writes, so one stuck read does not
                              stop every backup; far below stall_timeout_s, after
                              which such a worker is killed
    CREDIT_CAP_NS      1 s    of write time: the most credit reads can bank for
                              writes (workers.share)
    ROOM_WAIT_S        2 s    a write at a storage limit waits at most this long
                              for the evictor to make room (workers.room), looking
                              every ROOM_POLL_S (2 ms); after a wait that got none,
                              the worker's writes at the limit are dropped at once
                              for as long. Far below stall_timeout_s (the wait
                              counts as the write's I/O for the watchdog); a
                              cancel ends it within a poll, far inside
                              ABANDON_GRACE_S

The store's side (wall-clock file times, shared with other hosts):

    TOUCH_INTERVAL_S   1 s    a page's LRU stamp is renewed at most this often
                              per process: order at a coarse grain
    EVICT_REPORT_WAIT_S 1 s   the evictor waits this long for room to report a
                              removal (polling every EVICT_REPORT_POLL_S, 5 ms)
    STOP_GRACE_S       2 s    a child asked to stop has this long before SIGKILL
    DAMAGED_TTL_S      60 s   a page file a read found damaged (right size, bad
                              header, another key's, bad checksum) or could not
                              read (EACCES, EIO) is not
                              believed found again by a probe or rescan for this
                              long, unless this process writes it anew: a
                              repair by another host is seen after it
    LEASE_S            10 s   the eviction lease expires this long after its
                              holder's last refresh, so a dead holder is replaced
                              with no pid check (meaningless on another node)
    FUTURE_SLACK_S     60 s   a page stamp further ahead than this is not a last
                              access: hosts' clocks on one network filesystem
                              differ by seconds, not minutes
    FOREIGN_TMP_STALE_S 1 h   a temp file of another host's writer this old is
                              dead: no page write takes an hour
"""

# --- the scheduler's side ---------------------------------------------------------
AHEAD_MIN_S = 0.001
AHEAD_SHARE = 0.75
SPIN_CAP_S = 0.001
NO_TARGET_CAP_S = 0.005
DEVICE_WAIT_SLICE_S = 0.002
PROBE_WAIT_SLICE_S = 0.05
HEALTH_CHECK_S = 0.1
TARGET_CAP_S = 0.2
WAIT_SLICE_S = 0.2
PROBE_TTL_S = 0.25
SCAN_PROBE_WAIT_S = 0.5
ABANDON_GRACE_S = 1.0
ANSWER_LOST_S = 2.0

# --- close() ----------------------------------------------------------------------
FLUSH_POLL_S = 0.002
FLUSH_IDLE_S = 0.1
FLUSH_QUIET_S = 0.6
SLOW_CLOSE_S = 1.0
SLEEPERS_GONE_S = 5.0

# --- the worker's side ------------------------------------------------------------
BACKOFF_S = 0.0005
DEFER_POLL_S = 0.002
CHILD_READY_POLL_S = 0.002
SCAN_PUSH_POLL_S = 0.002
PARENT_CHECK_S = 0.25
PARENT_EXIT_S = 5.0
WRITE_DEFER_MAX_S = 0.5
STILL_S = WRITE_DEFER_MAX_S / 2
SLOW_IO_S = 0.5
CREDIT_CAP_NS = 1_000_000_000
ROOM_WAIT_S = 2.0
ROOM_POLL_S = 0.002

# --- the store's side -------------------------------------------------------------
TOUCH_INTERVAL_S = 1.0
EVICT_REPORT_WAIT_S = 1.0
EVICT_REPORT_POLL_S = 0.005
STOP_GRACE_S = 2.0
DAMAGED_TTL_S = 60.0
LEASE_S = 10.0
FUTURE_SLACK_S = 60.0
FOREIGN_TMP_STALE_S = 3600.0
