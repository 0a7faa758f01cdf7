"""Per-page status codes carried in completion records.

Owns the numbering and the names users see. Must not hold any logic.
"""
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

NAMES = {
    PENDING: "pending", OK: "ok", MISS: "miss", CORRUPT: "corrupt", FOREIGN: "foreign",
    WRONG_KEY: "wrong_key", UNREADABLE: "unreadable", NOSPACE: "nospace", DENIED: "denied",
    IOERROR: "ioerror", CANCELLED: "cancelled", WORKER_DIED: "worker_died", BUSY: "busy",
    DROPPED: "dropped",
}

# Statuses that mean "the file is not a usable page", counted as misses.
READ_MISSES = (MISS, CORRUPT, FOREIGN, WRONG_KEY, UNREADABLE)
