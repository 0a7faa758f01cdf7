"""GpuTime: where the simulated GPU's time went in one run of the reference scheduler.

Owns the tally of the GPU's timeline from the run's start to the loop seeing
its last batch end: time in batches, idle time by what the loop was waiting
for, and the loop's lateness in seeing that a batch had ended; and its
figures in a report (`gpu_figures`). Must not decide anything: the
scheduler reports each batch start and end and each idle iteration with its
cause; this only adds up.

The parts sum to the run's duration: busy_s + sum(wait_s) + late_s. Against
`none`, a run's extra TTFT is where its parts differ. The reference workload
keeps the GPU saturated once its first batch runs, so a wait before that
batch (`start_s`) shifts every later request by as much, and a wait or a
late step later on shifts every request behind it (decision 82).

Causes of an idle GPU (the loop's state at the idle iteration that starts
each interval):
  prefetch  requests wait for their prefetch (storage I/O), nothing else can run
  device    a ready request's pages are still on their way to the GPU (DeviceLoader)
  slots     a request waits for host slots (the lookup queue is blocked)
  arrival   nothing in the system to run: the next request has not arrived
"""
from __future__ import annotations

CAUSES = ("prefetch", "device", "slots", "arrival")


class GpuTime:
    def __init__(self):
        self.busy_s = 0.0
        self.wait_s = dict.fromkeys(CAUSES, 0.0)
        self.late_s = 0.0        # sum over batches: seen ended - ended
        self.late_max_s = 0.0
        self.start_s = None      # when the first batch started
        # Idle since `_mark`, waiting for `_why`; None while a batch runs. The
        # run starts idle, before any request is in.
        self._mark, self._why = 0.0, "arrival"

    def idle(self, now_s: float, why: str) -> None:
        """An iteration that found nothing to run, waiting for `why`."""
        if self._why is not None:
            self.wait_s[self._why] += now_s - self._mark
        self._mark, self._why = now_s, why

    def started(self, now_s: float) -> None:
        if self._why is not None:
            self.wait_s[self._why] += now_s - self._mark
            self._why = None
        if self.start_s is None:
            self.start_s = now_s

    def finished(self, batch, now_s: float) -> None:
        """The loop saw `batch` end at `now_s` (it ended at batch.end_s)."""
        self.busy_s += batch.end_s - batch.start_s
        late = now_s - batch.end_s
        self.late_s += late
        self.late_max_s = max(self.late_max_s, late)
        self._mark, self._why = now_s, None

    def to_dict(self) -> dict:
        return {"start_s": self.start_s, "busy_s": self.busy_s, "wait_s": dict(self.wait_s),
                "late_s": self.late_s, "late_max_s": self.late_max_s}


def gpu_figures(res) -> dict:
    """A RunResult's tally, with the first prefetch's times from the run's start
    (before the first batch the GPU waits for it): the report's `gpu` entry."""
    out = dict(res.gpu or {})
    if res.prefetch:
        r, t0 = res.prefetch[0], res.t0_ns   # sorted by submit time
        out["first_prefetch"] = {
            "rid": r.rid, "pages": r.pages, "submit_s": (r.submit_ns - t0) / 1e9,
            "done_s": (r.done_ns - t0) / 1e9 if r.done_ns else None,
            "on_device_s": (r.h2d_seen_ns - t0) / 1e9 if r.h2d_seen_ns else None}
    return out
