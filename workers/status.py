"""Per-page status codes carried in completion records.

Owns the numbering and the names users see (`Status(code).label`, `NAMES`).
Must not hold any logic. The module-level names (`status.OK`, ...) are the
enum's values as plain ints: numpy compares an array or a scalar of codes
with an int directly, where an IntEnum member costs it a slow conversion
(about 5 µs a compare on Python 3.11, paid per page on a drain).
"""
import enum


class Status(enum.IntEnum):
    PENDING = 0
    OK = 1
    MISS = 2          # no file for this key
    CORRUPT = 3       # bad magic, bad header checksum, short/long file, bad payload checksum
    FOREIGN = 4       # another geometry or format version
    WRONG_KEY = 5     # the header names another key (digest collision or a misplaced file)
    UNREADABLE = 6    # open/read failed: permission, a directory in its place, EIO
    NOSPACE = 7       # write failed: ENOSPC / EDQUOT / EFBIG
    DENIED = 8        # write failed: EACCES / EPERM / EROFS
    IOERROR = 9       # write failed for another reason
    CANCELLED = 10    # skipped because its op was cancelled
    WORKER_DIED = 11  # its worker died before finishing it
    BUSY = 12         # not submitted: every ring was full (backpressure)
    DROPPED = 13      # write not attempted, by choice under pressure: over the backup budget
                      # (errno 0) or over the store's capacity limits (errno ENOSPC)
    UNVERIFIED = 14   # a page without a checksum, refused because require_checksum is on

    @property
    def label(self) -> str:
        """The name users see in op.status_counts() and metrics()."""
        return self.name.lower()


PENDING = int(Status.PENDING)
OK = int(Status.OK)
MISS = int(Status.MISS)
CORRUPT = int(Status.CORRUPT)
FOREIGN = int(Status.FOREIGN)
WRONG_KEY = int(Status.WRONG_KEY)
UNREADABLE = int(Status.UNREADABLE)
NOSPACE = int(Status.NOSPACE)
DENIED = int(Status.DENIED)
IOERROR = int(Status.IOERROR)
CANCELLED = int(Status.CANCELLED)
WORKER_DIED = int(Status.WORKER_DIED)
BUSY = int(Status.BUSY)
DROPPED = int(Status.DROPPED)
UNVERIFIED = int(Status.UNVERIFIED)

NAMES = {int(s): s.label for s in Status}

# Statuses that mean "the file is not a usable page", counted as misses.
READ_MISSES = (MISS, CORRUPT, FOREIGN, WRONG_KEY, UNREADABLE, UNVERIFIED)
# Of those, a file that is there but cannot serve: damaged, or unreadable
# (EACCES, EIO, a directory or a symlink in its place). The probe would find it
# again by its name and size, so the index distrusts it (hicache_mp.engine.index) and
# the next backup writes it anew, as decision 81 says.
READ_DAMAGED = (CORRUPT, FOREIGN, WRONG_KEY, UNREADABLE, UNVERIFIED)
