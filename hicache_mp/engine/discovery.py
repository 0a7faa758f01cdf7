"""Discovery: which keys to ask the store about, so pages other engines wrote are found.

Owns the bookkeeping of miss probes and the choice of what to ask (`ask`:
the head of a run the index misses, or the whole run, less what was asked
within PROBE_TTL_S): when `exists()` meets a key the index does not know,
the engine hands a KIND_PROBE record for it (and for the keys after it, up
to PROBE_MAX) to a worker, which answers with one stat of the
page file: OK if a whole page file is there, MISS if not. The answer comes
back on the completion ring and `poll()` adds the digest to the index. A key
asked about is not asked again for PROBE_TTL_S (a negative cache), so a
scheduler that asks exists() in a loop costs the store one stat per key per
PROBE_TTL_S, and the scheduler's process never walks the store nor makes a
syscall for it. Must not touch files: workers do.

Why not a periodic rescan: at a million pages a walk is seconds of Python in
the scheduler's process, and still late. Why not a stat in exists(): it is a
metadata round trip on the scheduler's thread, per missing key, and on a
network filesystem that is milliseconds each (decision 29).
"""
import time

from workers import naming
from workers.timing import ANSWER_LOST_S, PROBE_TTL_S

# Keys probed per exists() call: a whole prefix another engine wrote must be
# found in one call, because SGLang's hit query stops at the first short answer
# and a hybrid model's trailing-page rule needs the prefix's last page (at 64,
# a 256-page prefix read as 64 pages, and a Mamba prefix as none), and a
# vLLM step's lookups of a long request (2,000 chunks) go in one batch. A
# probe is one stat on a worker; a full ring leaves the rest for the next call.
PROBE_MAX = 4096
_MEMORY = 1 << 16  # digests remembered for the negative cache, then forgotten at once


class Discovery:
    def __init__(self):
        self.asked: dict[bytes, float] = {}   # digest -> when it was last asked
        self.waiting: set[bytes] = set()      # asked and not yet answered
        # Asks in flight per digest: an answer to an older ask (drained late,
        # after the page was written and asked again) must not end the wait
        # for the newer one.
        self.pending: dict[bytes, int] = {}
        self.sent = 0
        self.found = 0

    def ask(self, keys, whole: bool, namespace: str, known, send) -> set:
        """Which of `keys` to ask the store about, asked through `send` (the
        digests to probe -> those handed out; a full ring keeps the rest for
        the next call); the digests among them still unanswered. `keys[0]` is
        missing from the index (`known`: its digests); with `whole` the keys
        after it that it misses too, up to PROBE_MAX. Within PROBE_TTL_S of
        the last asking a key is not asked again; if that ask is still
        unanswered, the caller waits for it all the same."""
        now = time.monotonic()
        asked = self._asked(keys, whole, namespace, known)
        ask = [d for d in asked if self.due(d, now)]
        if ask:
            self.mark(send(ask), now)
        return self.waiting.intersection(asked)

    def would_wait(self, keys, whole: bool, namespace: str, known) -> bool:
        """Whether `ask(keys, whole, ...)` would leave its caller something to
        wait for: a key it would ask now, or one still unanswered. False means
        every key it covers was answered within PROBE_TTL_S (the negative
        cache), so the index alone decides the caller's count."""
        now, waiting = time.monotonic(), self.waiting
        return any(d in waiting or self.due(d, now)
                   for d in self._asked(keys, whole, namespace, known))

    @staticmethod
    def _asked(keys, whole: bool, namespace: str, known) -> list:
        """The digests `ask` covers: keys[0]'s, and with `whole` those of the
        keys after it (up to PROBE_MAX) that `known` misses."""
        asked = [naming.key_digest(keys[0], namespace)]
        if whole:
            for key in keys[1:PROBE_MAX]:
                d = naming.key_digest(key, namespace)
                if d not in known:
                    asked.append(d)
        return asked

    def awaiting(self, keys, namespace: str) -> bool:
        """Whether a probe of one of `keys` is out and not yet answered."""
        waiting = self.waiting
        return any(naming.key_digest(k, namespace) in waiting for k in keys)

    def due(self, digest: bytes, now: float) -> bool:
        """May `digest` be asked now? Not within PROBE_TTL_S of the last asking
        (an answer lost with a dead worker is asked again after that too)."""
        last = self.asked.get(digest)
        return last is None or now - last >= PROBE_TTL_S

    def mark(self, digests, now: float) -> None:
        if len(self.asked) + len(digests) > _MEMORY:
            self.asked.clear()
            self.waiting.clear()
            self.pending.clear()
        for d in digests:
            prev = self.asked.get(d)
            # An ask unanswered for ANSWER_LOST_S went with a dead worker: not waited for.
            out = self.pending.get(d, 0) if prev is not None and now - prev < ANSWER_LOST_S else 0
            self.pending[d] = out + 1
            self.asked[d] = now
            self.waiting.add(d)
        self.sent += len(digests)

    def answered(self, digests: bytes, found: list) -> list:
        """Workers' answers: `digests` is 32 bytes per answer, `found` a bool
        each; returns the digests found (for the index). One call per drained
        batch: a prefix of misses is one pass here, not a method call each."""
        pending, waiting = self.pending, self.waiting
        hits = []
        for i, ok in enumerate(found):
            digest = digests[32 * i:32 * i + 32]
            left = pending.pop(digest, 1) - 1
            if left > 0 and not ok:
                pending[digest] = left   # a newer ask is still out: its answer decides
                continue
            waiting.discard(digest)
            if ok:
                hits.append(digest)
        if hits:
            self.found += len(hits)
            asked = self.asked
            for digest in hits:
                asked.pop(digest, None)  # known now; if it goes, it may be asked again at once
        return hits
