"""WorkerHandle: the parent's hold on one worker process, and its lifecycle state.

Owns the handle's rings and wake semaphore (closed once, or handed to the
successor), the watchdog's view of its progress, and `WorkerState` with the
one table of the moves between states. Must not decide when a process is
started, killed or reaped, nor when a move happens: workers.pool does, the
supervisor through it.

One handle is one process (a slot's generation). Its lifecycle:

    spawn ──► STARTING ──ready──► READY ──exited; respawn───────────────► GONE
                 │                  │                                      ▲
            start failed:       watchdog:                                  │
               killed             killed                                   │
                 ▼                  ▼                                      │
               FAILED             STUCK                                    │
                 └────────┬─────────┘                                      │
                       respawn ──► DYING ──reaped──────────────────────────┤
                          │                                                │
                          └─ no /dev/shm for new rings ─► DYING_UNREPLACED │
                                ──reaped──► REAPED ──respawn (its rings)───┘

Each respawn starts the slot's next handle at STARTING. Work goes to READY
handles only (to STARTING ones when none is ready); DYING and
DYING_UNREPLACED are the killed processes whose reaping lifts the
supervisor's fence on their pages' slots. A broken pool respawns nothing,
so a handle then stays where it is (a DYING one still goes GONE once
reaped); close() drops every handle where it stands.

`rings_closed` is kept apart from the state on purpose: it says whether
these rings may still be touched, and close() sets it for handles in every
state (a READY worker's rings are closed at shutdown, a DYING_UNREPLACED
one's stay open for its successor, a FAILED one's close when the pool breaks).
"""
import enum
from dataclasses import dataclass, field

from shm import Ring, WakeSemaphore
from workers.child import Child


class WorkerState(enum.Enum):
    STARTING = "starting"      # launched, not yet seen ready
    READY = "ready"            # takes work; an exit is reported by WorkerPool.dead()
    STUCK = "stuck"            # killed by the watchdog, not yet replaced
    FAILED = "failed"          # exited or timed out before ready (start_error), killed
    DYING = "dying"            # killed and replaced (or the pool broke); not reaped yet
    DYING_UNREPLACED = "dying_unreplaced"  # killed; its replacement waits to reuse its rings
    REAPED = "reaped"          # a DYING_UNREPLACED one reaped: respawn reuses its rings now
    GONE = "gone"              # reaped and done with: the slot is its successor's


S = WorkerState
# The only moves there are; anything else is a bug in the pool or supervisor.
NEXT = {
    S.STARTING: frozenset({S.READY, S.FAILED}),
    S.READY: frozenset({S.STUCK, S.GONE}),
    S.STUCK: frozenset({S.DYING, S.DYING_UNREPLACED}),
    S.FAILED: frozenset({S.DYING, S.DYING_UNREPLACED}),
    S.DYING: frozenset({S.GONE}),
    S.DYING_UNREPLACED: frozenset({S.REAPED}),
    S.REAPED: frozenset({S.GONE}),
    S.GONE: frozenset(),
}
KILLED_UNREAPED = frozenset({S.DYING, S.DYING_UNREPLACED})


class WorkerStateError(AssertionError):
    """A move the table (NEXT) does not have: the pool's bookkeeping is wrong."""


@dataclass(eq=False)
class WorkerHandle:
    index: int
    generation: int
    child: Child
    read_ring: Ring        # reads (prefetch)
    write_ring: Ring       # writes (backup): served after reads
    completion_ring: Ring  # both kinds' completions (and probe answers)
    wake: WakeSemaphore
    state: WorkerState = WorkerState.STARTING
    trail: list = field(default_factory=lambda: [WorkerState.STARTING])  # every state, in order
    rings_closed: bool = False
    start_error: str | None = None   # why it never became ready (FAILED)
    # The engine's watchdog: what it last saw the worker take from its rings, and when.
    seen_taken: tuple = (-1, -1)
    seen_at: float = 0.0
    looked_at: float = 0.0

    def to(self, new: WorkerState) -> None:
        """Move to `new`; WorkerStateError (and no move) if NEXT has no such move."""
        self.check_move(new)
        self.state = new
        self.trail.append(new)

    def check_move(self, new: WorkerState) -> None:
        """WorkerStateError unless NEXT has the move to `new`: for a caller that
        must know before it changes anything else."""
        if new not in NEXT[self.state]:
            raise WorkerStateError(f"hicache_mp-worker-{self.index} (generation "
                                   f"{self.generation}): {self.state.name} -> {new.name} is "
                                   f"not a move (from {self.state.name}: "
                                   f"{sorted(s.name for s in NEXT[self.state]) or 'none'})")

    def idle_with_work_s(self, now: float, watch_gap_s: float) -> float:
        """How long the worker has had records queued without taking any (0: it
        took one since the last look, or has none). One load per ring.

        A gap between two looks longer than `watch_gap_s` restarts the count:
        the caller did not poll then, so the worker may have sat on a full
        completion ring, which is no fault of its own."""
        taken = (self.read_ring.consumed(), self.write_ring.consumed())
        gap, self.looked_at = now - self.looked_at, now
        if taken != self.seen_taken or gap > watch_gap_s or \
                not (self.read_ring.pending() or self.write_ring.pending()):
            self.seen_taken, self.seen_at = taken, now
            return 0.0
        return now - self.seen_at

    @property
    def rings(self) -> tuple:
        return (self.read_ring, self.write_ring, self.completion_ring, self.wake)

    def close_rings(self) -> None:
        if not self.rings_closed:
            self.rings_closed = True
            for r in self.rings:
                r.close()

    def hand_over_rings(self) -> tuple:
        """The rings, for the successor to reuse (it owns and closes them now)."""
        self.rings_closed = True
        return self.rings

    @property
    def pid(self) -> int:
        return self.child.pid

    def alive(self) -> bool:
        return self.child.alive()
